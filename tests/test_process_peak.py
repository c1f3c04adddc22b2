"""process_peak_bytes: a budget covers the whole process, so the peak a reset_peak discards still counts."""

from __future__ import annotations

import pytest
import torch

from edgetorch.measure.process import peak_bytes, process_peak_bytes, reset_peak, restart_peaks

BIG = 256 * 2**20  # far above glibc's largest mmap threshold (32 MiB): freed, it leaves the process


def _touch(device: torch.device) -> None:
    block = torch.ones(BIG // 4, device=device)  # written, so resident
    assert float(block[-1]) == 1.0
    del block


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))])
def test_a_reset_discards_the_step_peak_but_not_the_process_peak(device):
    device = torch.device(device)
    restart_peaks(device)
    _touch(device)
    high = process_peak_bytes(device)
    reset_peak(device)
    assert peak_bytes(device) < high - BIG // 2  # the window after the reset no longer sees it
    assert process_peak_bytes(device) >= high  # the process still does
    restart_peaks(device)
    assert process_peak_bytes(device) < high - BIG // 2  # counted from now
