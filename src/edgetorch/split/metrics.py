"""The split server's Prometheus counters: requests by path and code, errors, dropped connections
and the inference-time histogram, rendered in the text exposition format for ``GET /metrics``.
"""

from __future__ import annotations

import threading

# Seconds; the tail of a CPU model is milliseconds to seconds.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    """Counters and a latency histogram, rendered in the Prometheus text format (version 0.0.4).

    Written by hand rather than with ``prometheus_client`` because four series do not justify a
    dependency. Every update happens on the event loop of one process; with several uvicorn
    workers each has its own numbers (Prometheus sums them across targets).
    """

    def __init__(self, buckets: tuple[float, ...] = _LATENCY_BUCKETS):
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}
        self.errors: dict[int, int] = {}
        self.dropped: dict[str, int] = {}
        self.buckets = buckets
        self.bucket_counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.latency_sum = 0.0
        self.latency_count = 0

    def record_request(self, path: str, status: int) -> None:
        """Count one answered request (``path`` must come from a small fixed set of labels)."""
        with self._lock:
            self.requests[(path, status)] = self.requests.get((path, status), 0) + 1
            if status >= 400:
                self.errors[status] = self.errors.get(status, 0) + 1

    def record_drop(self, reason: str) -> None:
        """Count one connection the server closed to protect the others (``reason`` from a fixed set)."""
        with self._lock:
            self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def observe_inference(self, seconds: float) -> None:
        """Add one decode + tail duration to the histogram."""
        with self._lock:
            index = next((i for i, bound in enumerate(self.buckets) if seconds <= bound), len(self.buckets))
            self.bucket_counts[index] += 1
            self.latency_sum += seconds
            self.latency_count += 1

    def render(self) -> str:
        """The exposition text."""
        with self._lock:
            lines = ["# HELP edgetorch_split_requests_total HTTP requests answered, by path and status code.",
                     "# TYPE edgetorch_split_requests_total counter"]
            lines += [f'edgetorch_split_requests_total{{path="{_label(path)}",code="{code}"}} {count}'
                      for (path, code), count in sorted(self.requests.items())]
            lines += ["# HELP edgetorch_split_errors_total Requests answered with a 4xx or 5xx, by status code.",
                      "# TYPE edgetorch_split_errors_total counter"]
            lines += [f'edgetorch_split_errors_total{{code="{code}"}} {count}' for code, count in sorted(self.errors.items())]
            lines += ["# HELP edgetorch_split_connections_dropped_total Connections the server closed to protect the "
                      "others, by reason (write_timeout, pipelined, evicted).",
                      "# TYPE edgetorch_split_connections_dropped_total counter"]
            lines += [f'edgetorch_split_connections_dropped_total{{reason="{reason}"}} {count}'
                      for reason, count in sorted(self.dropped.items())]
            lines += ["# HELP edgetorch_split_inference_seconds Decode plus tail time of answered /infer requests.",
                      "# TYPE edgetorch_split_inference_seconds histogram"]
            cumulative = 0
            for bound, count in zip((*map(repr, self.buckets), "+Inf"), self.bucket_counts):
                cumulative += count
                lines.append(f'edgetorch_split_inference_seconds_bucket{{le="{bound}"}} {cumulative}')
            lines += [f"edgetorch_split_inference_seconds_sum {self.latency_sum!r}",
                      f"edgetorch_split_inference_seconds_count {self.latency_count}"]
        return "\n".join(lines) + "\n"


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
