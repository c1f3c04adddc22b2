"""`edgetorch profile`: a fresh process per policy, ledger and measured numbers side by side."""

import json

from typer.testing import CliRunner

from edgetorch.cli import app

runner = CliRunner()


def test_profile_writes_json_and_plot(tmp_path):
    out, png = tmp_path / "p.json", tmp_path / "p.png"
    result = runner.invoke(app, [
        "profile", "--model", "zoo:cnn", "--batch", "8", "--resolution", "28",
        "--policy", "dense", "--policy", "bitmap", "--policy", "bitmap:threshold=0.05",
        "--json", str(out), "--plot", str(png),
    ])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert (data["model"], data["batch"], data["resolution"]) == ("zoo:cnn", 8, 28)
    dense, bitmap, pruned = data["results"]
    assert [r["policy"] for r in data["results"]] == ["dense", "bitmap", "bitmap:threshold=0.05"]
    for r in data["results"]:
        assert isinstance(r["activation_bytes"], int) and isinstance(r["peak_memory_bytes"], int)
        assert r["peak_memory_bytes"] > r["activation_bytes"] > 0
        assert r["dense_activation_bytes"] == dense["dense_activation_bytes"]
        assert r["parameter_bytes"] > 0 and r["optimizer_state_bytes"] == r["parameter_bytes"]
    assert dense["activation_bytes"] == dense["dense_activation_bytes"]
    assert pruned["activation_bytes"] < bitmap["activation_bytes"] < dense["activation_bytes"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "measured" in result.output and "ledger" in result.output


def test_profile_accepts_a_python_path_factory_and_checkpointing(tmp_path):
    out = tmp_path / "p.json"
    result = runner.invoke(app, [
        "profile", "--model", "torchvision.models:resnet18", "--batch", "2", "--resolution", "32",
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
