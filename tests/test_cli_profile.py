"""`edgetorch profile`: a fresh process per policy, ledger and measured numbers side by side."""

import json

from typer.testing import CliRunner

from edgetorch.cli import app

runner = CliRunner()


def test_profile_writes_json_and_plot(tmp_path):
    out, png = tmp_path / "p.json", tmp_path / "p.png"
    result = runner.invoke(app, [
        "profile", "--model", "zoo:cnn", "--batch-size", "8", "--size", "28",
        "--policy", "bitmap", "--policy", "bitmap:threshold=0.05",  # each a fresh process: two, not more
        "--json", str(out), "--plot", str(png),
    ])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert (data["model"], data["batch"], data["resolution"]) == ("zoo:cnn", 8, 28)
    bitmap, pruned = data["results"]
    assert [r["policy"] for r in data["results"]] == ["bitmap", "bitmap:threshold=0.05"]
    for r in data["results"]:
        assert isinstance(r["activation_bytes"], int) and isinstance(r["peak_memory_bytes"], int)
        assert r["peak_memory_bytes"] > r["activation_bytes"] > 0
        assert r["dense_activation_bytes"] == bitmap["dense_activation_bytes"]
        assert r["parameter_bytes"] > 0 and r["optimizer_state_bytes"] == r["parameter_bytes"]
    assert pruned["activation_bytes"] < bitmap["activation_bytes"] < bitmap["dense_activation_bytes"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "measured" in result.output and "ledger" in result.output


def test_profile_accepts_a_python_path_factory_and_checkpointing(tmp_path):
    out = tmp_path / "p.json"
    result = runner.invoke(app, [
        "profile", "--model", "torchvision.models:resnet18", "--batch-size", "2", "--size", "32",
        "--policy", "bitmap", "--policy", "bitmap+checkpoint", "--json", str(out),
    ])
    assert result.exit_code == 0, result.output
    plain, checkpointed = json.loads(out.read_text())["results"]
    assert plain["activation_bytes"] > 0 and checkpointed["policy"] == "bitmap+checkpoint"
    # recomputing the stages in backward keeps fewer saved bytes alive at once
    assert checkpointed["peak_live_activation_bytes"] < plain["peak_live_activation_bytes"]


def test_profile_rejects_bad_names():
    result = runner.invoke(app, ["profile", "--model", "zoo:cnn", "--policy", "zip"])
    assert result.exit_code == 2 and "unknown policy" in result.output
    result = runner.invoke(app, ["profile", "--model", "torchvision:nonet", "--policy", "dense"])
    assert result.exit_code == 2 and "nonet" in result.output
    result = runner.invoke(app, ["profile", "--model", "zoo:cnn", "--policy", "bitmap:threshold=-1"])
    assert result.exit_code == 2 and ">= 0" in result.output


def _skeleton(value, maps=()):
    """A JSON value's keys, in order, with leaves None, a list as its first item's skeleton, and the
    dicts under a key in ``maps`` (keyed by op or module names) as their first entry's skeleton."""
    if isinstance(value, dict):
        return {k: [_skeleton(next(iter(v.values()), None), maps)] if k in maps else _skeleton(v, maps)
                for k, v in value.items()}
    if isinstance(value, list):
        return [_skeleton(item, maps) for item in value[:1]]
    return None


_TOTALS = dict.fromkeys(["count", "dense_bytes", "stored_bytes", "numel", "nnz", "sparsity"])
_COMPARISON = dict.fromkeys(["name", "cosine", "relative_error", "norm", "reference_norm", "negligible"])
# `edgetorch profile --fidelity --json` as written before ProfileResult (at cacdc18): keys, order, nesting.
PROFILE_RECORD = {
    "model": None, "batch": None, "resolution": None, "device": None, "freeze_batchnorm": None, "machine": [None],
    "results": [{
        **dict.fromkeys(["policy", "activation_bytes", "dense_activation_bytes", "peak_live_activation_bytes",
                         "sparsity", "peak_memory_bytes", "peak_memory_kind", "rss_before_step_bytes",
                         "step_peak_increase_bytes", "forward_increase_bytes", "held_after_forward_bytes",
                         "rss_after_forward_bytes", "uss_after_forward_bytes", "parameter_bytes", "buffer_bytes",
                         "gradient_bytes", "optimizer_state_bytes", "step_seconds"]),
        "by_op": [_TOTALS], "by_form": [_TOTALS], "by_module_type": [_TOTALS],
        "fidelity": {"policy": None, "worst_cosine": None, "worst_parameter": None, "max_relative_error": None,
                     "input": _COMPARISON, "no_input_gradient": None, "loss": None, "reference_loss": None,
                     "parameters": [_COMPARISON]},
    }],
}  # fmt: skip


def test_profile_json_keeps_its_format(tmp_path):
    """ProfileResult.to_json writes `--json` key for key as the untyped result did (benches and
    committed results read it)."""
    out = tmp_path / "p.json"
    result = runner.invoke(app, ["profile", "--model", "zoo:cnn", "--batch-size", "4", "--size", "28",
                                 "--policy", "bitmap", "--fidelity", "--json", str(out)])
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())
    skeleton = _skeleton(record, maps=("machine", "by_op", "by_form", "by_module_type"))
    assert json.dumps(skeleton) == json.dumps(PROFILE_RECORD)  # as text: the key order counts too
    (r,) = record["results"]
    assert r["policy"] == r["fidelity"]["policy"] == "bitmap" and r["fidelity"]["worst_cosine"] == 1.0


def test_a_policy_profile_crosses_the_process_boundary_whole():
    """The worker prints dataclasses.asdict as JSON; PolicyProfile.from_dict gives back the same
    profile, the non-finite fidelity numbers included, which to_json writes as null."""
    import dataclasses
    import math

    from edgetorch.activations.fidelity import GradientComparison, GradientFidelity
    from edgetorch.activations.profile import PolicyProfile
    from edgetorch.measure.ledger import Totals

    moved = GradientComparison("fc.bias", math.nan, math.inf, 1.0, 0.0)
    fidelity = GradientFidelity("bitmap", (moved, GradientComparison("fc.weight", 0.5, 0.25, 2.0, 3.0)), None,
                                "inputs are torch.int64", 2.5, math.nan)
    totals = {"conv2d": Totals(2, 800, 400, 200, 100)}
    sent = PolicyProfile("bitmap", 400, 800, 400, 0.5, 10_000, "peak_rss", 9_000, 700, 500, 9_500, 9_600, None,
                         64, 0, 64, 64, 0.01, totals, totals, totals, fidelity)
    got = PolicyProfile.from_dict(json.loads(json.dumps(dataclasses.asdict(sent))))
    first = got.fidelity.parameters[0]
    assert math.isnan(first.cosine) and first.relative_error == math.inf and math.isnan(got.fidelity.reference_loss)
    assert got.by_op == totals and got.fidelity.parameters[1] == fidelity.parameters[1]
    assert got.to_json() == sent.to_json()
    record = got.to_json()["fidelity"]
    assert record["parameters"][0]["cosine"] is None and record["parameters"][0]["relative_error"] is None
    assert record["worst_cosine"] is None and record["worst_parameter"] == "fc.bias"
    assert got.stored_over_dense == 0.5
