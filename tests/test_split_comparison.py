"""BottleFit against the paper's baselines (edgetorch.split.comparison): the rows, where they train, what they say."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from edgetorch.split import OffloadScore, SplitAccuracy, StageConfig
from edgetorch.split.bottlefit import BottleFitConfig, StageRun, build_student
from edgetorch.split.comparison import (STAGE1_ONLY, TABLE1_BASELINES, TABLE2_VARIANTS, ComparisonRow, paper_claims,
                                        plot_accuracy_vs_bytes, train_rows)
from edgetorch.zoo import build_model

SIZE = 16


def _teacher_and_data():
    torch.manual_seed(0)
    teacher = build_model("torchvision:resnet18", num_classes=4).eval()
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.rand(16, 3, SIZE, SIZE, generator=gen), torch.randint(0, 4, (16,), generator=gen))
    return teacher, data


def test_rows_train_in_their_directories_share_stage_1_and_resume(tmp_path):
    teacher, data = _teacher_and_data()
    ce, autoencoder = TABLE1_BASELINES[0], TABLE1_BASELINES[3]
    methods = (ce, autoencoder, TABLE2_VARIANTS[0])
    lines: list[str] = []
    rows = train_rows(teacher, data, data, 3, methods, epochs=1, batch_size=8, out_dir=tmp_path, log=lines.append)
    assert [r.method for r in rows] == [ce.name, autoencoder.name, STAGE1_ONLY.name, TABLE2_VARIANTS[0].name]
    assert [r.family for r in rows] == ["baseline", "baseline", "bottlefit", "bottlefit"]
    assert sorted(p.name for p in (tmp_path / "C3").iterdir()) == [
        "autoencoder", "conventional__ce", "stage1-ghnd", "stage2-ft-fe"]
    assert rows[0].stage.config.epochs == 2 and rows[3].stage.config.epochs == 1  # a baseline: both stages' epochs
    assert rows[3].stage1_seconds == rows[2].stage.seconds and rows[2].stage1_seconds is None
    assert all(line.startswith("C=3 ") for line in lines)
    record = rows[3].to_json()
    assert list(record) == ["method", "family", "channels", "float_accuracy", "quantized_accuracy",
                            "bottleneck_shape", "float32_bytes", "payload_bytes", "coded_payload_bytes", "coded_accuracy", "loss_history",
                            "train_seconds", "seconds_this_run", "config", "stage1_train_seconds"]
    assert "stage1_train_seconds" not in rows[0].to_json()
    # every stage is found finished: the same rows again, nothing trained
    again = train_rows(teacher, data, data, 3, methods, epochs=1, batch_size=8, out_dir=tmp_path)
    assert [(r.accuracy, r.stage.loss_history) for r in again] == [(r.accuracy, r.stage.loss_history) for r in rows]


def test_a_baseline_starts_from_bottlefits_seeded_student():
    teacher, _ = _teacher_and_data()
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    baseline = TABLE1_BASELINES[0].student(teacher, 3)
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's random state is left alone
    bottlefit = build_student(teacher, BottleFitConfig(channels=3))
    assert all(torch.equal(a, b) for a, b in zip(baseline.state_dict().values(), bottlefit.state_dict().values()))


def test_fig5_is_drawn_from_the_rows(tmp_path):
    teacher, data = _teacher_and_data()
    rows = train_rows(teacher, data, data, 3, (*TABLE1_BASELINES, *TABLE2_VARIANTS), 1, 8, tmp_path)
    files = {"png": OffloadScore(700.0, 0.5), "jpeg90": OffloadScore(300.0, 0.45), "jpeg10": OffloadScore(90.0, 0.3)}
    path = plot_accuracy_vs_bytes(rows, files, 0.5, tmp_path / "fig5.png", TABLE2_VARIANTS[0].name, (3,), "title")
    assert path.read_bytes().startswith(b"\x89PNG")


def test_paper_claims_compare_bottlefit_with_the_best_baseline_but_the_autoencoder():
    stage = StageRun("stage", StageConfig(loss="ce", trainable="all"), [1.0], 1.0, 0.0)
    accuracy = {"Conventional (CE)": 0.50, "KD": 0.55, "HND": 0.52, "Autoencoder": 0.90, STAGE1_ONLY.name: 0.40,
                "GHND -> FT (FE)": 0.60, "GHND -> KD (FE)": 0.61, "GHND -> FT": 0.58, "GHND -> KD": 0.62}
    rows = [ComparisonRow(name, "x", 3, SplitAccuracy(q + (0.05 if name == "HND" else 0.0), q, (3, 4, 4), 192, 60),
                          stage) for name, q in accuracy.items()]
    rows.append(ComparisonRow("KD", "baseline", 12, SplitAccuracy(1.0, 1.0, (12, 4, 4), 768, 200), stage))  # other C
    claims = paper_claims(rows, 3, "GHND -> FT (FE)")
    assert (claims.best_baseline, claims.bottlefit_min, claims.bottlefit_max) == ("KD", 0.58, 0.62)
    assert claims.deployed_gain_points == pytest.approx(5.0)
    assert claims.kd_minus_ce_points == pytest.approx(5.0) and claims.hnd_minus_kd_points == pytest.approx(-3.0)
    assert claims.autoencoder_minus_best_baseline_points == pytest.approx(35.0)
    assert claims.max_quantization_change_points == pytest.approx(5.0)
