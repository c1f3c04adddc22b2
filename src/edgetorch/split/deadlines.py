"""The tail server's default deadlines, in a module that imports nothing.

The server (:class:`~edgetorch.split.server.ServerConfig`, which needs FastAPI) keeps them, and the
clients that check them (:mod:`~edgetorch.split.probe`, :mod:`~edgetorch.split.fuzz` and
``edgetorch split probe``, which must not need FastAPI) expect them: one value read by both, so a
default probe checks a default server.
"""

# Seconds a connection has to deliver a complete request line and headers, else 408 and close.
HEADER_TIMEOUT_S = 10.0
# Seconds the whole body of a POST /infer has to arrive in after its headers, else 408 and close.
READ_TIMEOUT_S = 30.0
