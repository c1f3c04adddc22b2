"""Memory accounting: the saved-tensor ledger (formulas) and measured process memory (the OS)."""

from .process import peak_rss_bytes, reset_peak_rss, rss_bytes, run_fresh, uss_bytes

__all__ = ["peak_rss_bytes", "reset_peak_rss", "rss_bytes", "run_fresh", "uss_bytes"]
