"""Crafted files against every loader: the memory and time each refusal took, measured from the attack tests.

The tests assert the outcome (the package's own error) and the memory bound (peak RSS of a fresh
process < 256 MiB above the process at rest); they never assert time, since the machines are shared.
This script runs them and records both: each fresh-process case's peak-RSS growth and seconds
(tests/_bounded.py appends one line per case when EDGETORCH_HOSTILE_LOG is set), and every attack
test's duration from pytest's JUnit XML (set-up included: an upper bound on the refusal's time).

Run: python bench/hostile_inputs.py   (about 5 minutes on 2 cores)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

from _common import mib, table, write_results

ROOT = Path(__file__).resolve().parent.parent
SUITES = {  # file: what it attacks (-k selects within a file)
    "tests/test_files.py": "the bounded reader itself (FIFO, symlink loop, size, JSON depth)",
    "tests/test_split_attack.py": "split artifacts: manifests, safetensors headers, ONNX heads, class names",
    "tests/test_weights_attack.py": "`finetune --weights` / read_weights",
    "tests/test_json_loaders.py": "`split plan` profiles and accuracies, `split export --trained` records",
    "tests/test_reduce_load_attack.py": "`edgetorch.reduce.load` records and weights",
    "tests/test_data_folder.py": "image folders and CSVs",
    "tests/test_finetune.py::test_an_edited_checkpoint_state_is_a_checkpoint_error": "finetune checkpoint state.json",
    "tests/test_split_server.py": "the tail server (malformed, slow and flooding clients)",
}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        log, junit = Path(tmp) / "cases.jsonl", Path(tmp) / "junit.xml"
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
                               *SUITES], cwd=ROOT, env={**os.environ, "EDGETORCH_HOSTILE_LOG": str(log)})
        cases = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        tests = [{"file": c.get("file") or c.get("classname", "").replace(".", "/") + ".py", "name": c.get("name"),
                  "seconds": float(c.get("time", 0)),
                  "outcome": "failed" if c.find("failure") is not None or c.find("error") is not None
                  else "skipped" if c.find("skipped") is not None else "passed"}
                 for c in ET.parse(junit).getroot().iter("testcase")]
    per_file: dict[str, list[dict]] = defaultdict(list)
    for test in tests:
        per_file[test["file"]].append(test)
    file_rows = [(name, len(rows), sum(r["outcome"] == "passed" for r in rows),
                  sum(r["outcome"] == "failed" for r in rows), f"{max(r['seconds'] for r in rows):.2f}",
                  f"{sorted(r['seconds'] for r in rows)[len(rows) // 2]:.2f}") for name, rows in sorted(per_file.items())]
    case_rows = [(c["case"].split("::", 1)[-1], c["error"] or "returned", mib(c["growth"]), f"{c['seconds']:.2f}")
                 for c in cases]
    worst_growth = max((c["growth"] for c in cases), default=0)
    body = "\n\n".join([
        "What each attack suite covers:\n\n" + "\n".join(f"- `{k}`: {v}" for k, v in SUITES.items()),
        "Per test file: tests, passed, failed, and the slowest and median test in seconds (set-up included, "
        "so an upper bound on the time a refusal took):\n\n"
        + table(["file", "tests", "passed", "failed", "slowest s", "median s"], file_rows),
        f"Cases run in a fresh process (tests/_bounded.py): the error raised, the peak-RSS growth over the "
        f"process at rest (MiB; bound 256) and the seconds the loader took. Worst growth: {mib(worst_growth)} MiB.\n\n"
        + table(["case", "raised", "peak RSS growth MiB", "seconds"], case_rows),
    ])
    write_results("hostile_inputs", "Crafted inputs against every loader: memory and time of each refusal", body,
                  {"pytest_exit_code": done.returncode, "tests": tests, "fresh_process_cases": cases})
    if done.returncode:
        sys.exit(done.returncode)


if __name__ == "__main__":
    main()
