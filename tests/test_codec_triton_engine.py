"""The engine's GPU path under Triton's interpreter: test_codec_triton's engine tests, in a worker of
their own (see ``run_interpreted``)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="Triton is not installed (it ships with CUDA builds of torch)")

from test_codec_triton import ENGINE_SHARD, parent_only, run_interpreted  # noqa: E402


@pytest.mark.slow  # about two minutes
@parent_only("this process already interprets the kernels")
def test_engine_gpu_path_under_interpreter() -> None:
    run_interpreted(ENGINE_SHARD)
