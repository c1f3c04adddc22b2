"""The split tail server's defaults (deadlines and limits), in a module that imports nothing.

The server (:class:`~edgetorch.split.server.ServerConfig`, which needs FastAPI) keeps them, the
clients that check them (:mod:`~edgetorch.split.probe`, :mod:`~edgetorch.split.fuzz` and
``edgetorch split probe``, which must not need FastAPI) expect them, and ``edgetorch split serve``
shows them as its options' defaults. It sits outside :mod:`edgetorch.split`, whose package imports
torch: reading a default here costs ``edgetorch --help`` nothing. One value read by all, so a
default probe checks a default server.
"""

# Seconds a connection has to deliver a complete request line and headers, else 408 and close.
HEADER_TIMEOUT_S = 10.0
# Seconds the whole body of a POST /infer has to arrive in after its headers, else 408 and close.
READ_TIMEOUT_S = 30.0
# Seconds an idle keep-alive connection stays open.
KEEP_ALIVE_S = 5.0
# Seconds a client that stops reading its answer is kept, then dropped.
WRITE_TIMEOUT_S = 30.0
# Connections kept open (a new one closes the longest idle); requests beyond it get 503.
MAX_CONNECTIONS = 2048
# Samples one payload may hold; more get 413 before decoding.
MAX_BATCH = 1024
