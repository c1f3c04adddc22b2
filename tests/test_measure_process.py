"""run_fresh: a worker in a fresh interpreter, payload as JSON on stdin, its last JSON line back."""

import pytest

from edgetorch.measure.process import HONEST_MALLOC_ENV, run_fresh


def test_a_script_runs_in_its_worker_mode_with_the_payload_and_the_pinned_allocator(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(
        "import json, os, sys\n"
        "assert sys.argv[1:] == ['--worker']\n"
        "print('noise before the result')\n"
        "print(json.dumps({'got': json.load(sys.stdin), 'env': {k: os.environ.get(k) for k in %r}}))\n"
        % sorted(HONEST_MALLOC_ENV)
    )
    out = run_fresh(str(script), {"spec": "dense", "n": 3})
    assert out == {"got": {"spec": "dense", "n": 3}, "env": dict(sorted(HONEST_MALLOC_ENV.items()))}


def test_a_failing_worker_raises_with_its_stderr(tmp_path):
    script = tmp_path / "bad.py"
    script.write_text("import sys\nsys.exit('the worker could not start')\n")
    with pytest.raises(RuntimeError, match="the worker could not start"):
        run_fresh(str(script), {})
    with pytest.raises(RuntimeError, match="No module named"):
        run_fresh("edgetorch_no_such_module", {})
