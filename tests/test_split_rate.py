"""Rate-aware split payloads (issue 27): payload version 3 (fixed per-channel steps kept in the code
tables, entropy-coded codes, a 16-byte header), its decoder under hostile input, and the rate term of
stage 2 (`split train --rate-weight` end to end is in test_split_train)."""

from __future__ import annotations

import random
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from _coded_fuzz import fuzz_decoder
from safetensors.torch import load, save

from edgetorch.split.coded import CodeTables, FixedSteps, fit_code_tables
from edgetorch.split.fuzz import reseal
from edgetorch.split.payload import PayloadError, decode, encode, payload_size, read_header
from edgetorch.split.rate import RateTerm

torch.manual_seed(0)
TRAIN = torch.relu(torch.randn(64, 3, 4, 4))
STEPS = FixedSteps.fit(TRAIN)
TABLES = fit_code_tables(STEPS.quantize(TRAIN), STEPS)


def test_golden_bytes():
    steps = FixedSteps(np.array([0.5], dtype=np.float32), np.array([0], dtype=np.uint8), (1, 4))
    tables = CodeTables(torch.tensor([[8, 4, 2, 1] + [0] * 252]), steps)
    # SHA-256 of the counts (uint64), then scale (float32), zero point (uint8), sample shape (uint32)
    assert tables.digest.hex() == "bacd26da"
    x = torch.tensor([[[0.0, 0.5, 1.0, 0.0]], [[0.0, 0.0, 0.0, 1.6]]])  # codes 0 1 2 0 / 0 0 0 3
    blob = encode(x, tables=tables)
    assert blob.hex() == (
        "4554425103" "01" "c515af2a" "0200" "bacd26da"  # magic, v3, float32, CRC, 2 samples, digest
        "5b4b3490" "01000000")  # two rANS words
    assert len(blob) == 24 < payload_size(x.shape)
    assert decode(blob, tables=tables).tolist() == [[[0.0, 0.5, 1.0, 0.0]], [[0.0, 0.0, 0.0, 1.5]]]
    assert read_header(blob, tables).shape == (2, 1, 4)


def test_digest_pins_the_steps_and_tables_round_trip_through_safetensors():
    loaded = CodeTables.from_tensors(load(save(TABLES.to_tensors())))
    assert loaded.digest == TABLES.digest and loaded.steps.sample_shape == (3, 4, 4)
    assert np.array_equal(loaded.steps.scale, STEPS.scale)
    nudged = FixedSteps(STEPS.scale * np.float32(1.001), STEPS.zero_point, STEPS.sample_shape)
    assert CodeTables(TABLES.counts, nudged).digest != TABLES.digest
    assert CodeTables(TABLES.counts).digest != TABLES.digest  # the same counts without steps: another table set
    with pytest.raises(PayloadError, match="scale must be finite and > 0"):
        FixedSteps(np.array([0.0, 1, 1], dtype=np.float32), STEPS.zero_point, (3, 4, 4))
    with pytest.raises(PayloadError, match="one scale and zero point per channel"):
        FixedSteps(STEPS.scale, STEPS.zero_point, (2, 4, 4))
    with pytest.raises(PayloadError, match="overflow"):
        FixedSteps(np.full(3, 3e38, dtype=np.float32), np.full(3, 0, dtype=np.uint8), (3, 4, 4))
    with pytest.raises(PayloadError, match="sample shape"):
        FixedSteps(STEPS.scale, STEPS.zero_point, (3, 2**11, 2**11))
    tensors = TABLES.to_tensors()
    tensors["sample_shape"] = torch.tensor([3, -4, 4])
    with pytest.raises(PayloadError, match="sample shape is 1..7 positive dims"):
        CodeTables.from_tensors(tensors)
    with pytest.raises(PayloadError, match="fixed steps cover 3 channels, the counts 2"):
        CodeTables(torch.ones(2, 256, dtype=torch.int64), STEPS)


@settings(max_examples=60, deadline=None)
@given(batch=st.integers(1, 5), dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
       spread=st.floats(0.1, 3.0), seed=st.integers(0, 2**31))
def test_decodes_to_the_steps_rounding_of_the_tensor(batch, dtype, spread, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.relu(torch.randn(batch, 3, 4, 4, generator=g)) * spread).to(dtype)
    blob = encode(x, tables=TABLES)
    assert len(blob) <= payload_size(x.shape)  # never above the 8-bit payload: version 1 when that is smaller
    y = decode(blob, tables=TABLES)
    assert y.dtype == dtype and y.shape == x.shape
    if read_header(blob, TABLES).version == 3:
        assert torch.equal(y, STEPS.dequantize(STEPS.quantize(x), dtype))
        inside = x.double() <= torch.from_numpy(STEPS.scale.astype(np.float64) * (255 - STEPS.zero_point)).view(1, 3, 1, 1)
        error = (y.double() - x.double()).abs() - torch.from_numpy(STEPS.scale / 2).double().view(1, 3, 1, 1)
        assert bool((error[inside] <= 1e-2 * x.double().abs().max() + 1e-6).all())  # half a step (+ dtype rounding)
    else:
        assert torch.equal(y, decode(encode(x)))


def test_fewer_bytes_than_version_2_on_training_like_codes():
    x = torch.relu(torch.randn(1, 3, 4, 4, generator=torch.Generator().manual_seed(5)))
    v2 = fit_code_tables(__import__("edgetorch.split.payload", fromlist=["quantize"]).quantize(TRAIN)[0])
    assert len(encode(x, tables=TABLES)) < len(encode(x, tables=v2)) < len(encode(x))


@pytest.mark.parametrize("edit, match", [
    (lambda b: b[:-1], "CRC"),
    (lambda b: b[:12], "version-3 header is 16"),
    (lambda b: reseal(b + b"\1\0\0\0"), "does not hold exactly the codes"),
    (lambda b: reseal(b[:10] + b"\0\0" + b[12:]), "at least one sample"),
    (lambda b: reseal(b[:5] + b"\x09" + b[6:]), "restored dtype code 9"),
    (lambda b: reseal(b[:12] + b"\0\0\0\0" + b[16:]), "use the same artifact on both sides"),
    (lambda b: reseal(b[:10] + struct.pack("<H", 60_000) + b[12:]), "above the limit"),
])
def test_malformed_version_3_payloads_are_payload_errors(edit, match):
    blob = encode(torch.relu(torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(3))), tables=TABLES)
    assert read_header(blob, TABLES).version == 3
    with pytest.raises(PayloadError, match=match):
        decode(edit(blob), tables=TABLES, max_numel=2**16)


def test_version_3_needs_its_own_tables():
    blob = encode(torch.relu(torch.randn(1, 3, 4, 4)), tables=TABLES)
    with pytest.raises(PayloadError, match="decodes only with the code tables"):
        decode(blob)
    with pytest.raises(PayloadError, match="use the same artifact"):
        decode(blob, tables=CodeTables(TABLES.counts))
    with pytest.raises(PayloadError, match="samples of shape \\(3, 4, 4\\)"):
        encode(torch.rand(1, 3, 4, 5), tables=TABLES)


@pytest.mark.slow  # 10,000 payloads: about 5 s
def test_ten_thousand_fuzzed_version_3_payloads_decode_finite_or_are_payload_errors():
    """Issue 27's hostile-input target for version 3: flips, cuts, extensions, spliced words, each
    resealed past the CRC, within bounded memory."""
    rng = random.Random(3)
    g = torch.Generator().manual_seed(3)
    valid = [encode(torch.relu(torch.randn(rng.randint(1, 6), 3, 4, 4, generator=g)) * rng.uniform(0.1, 2), tables=TABLES)
             for _ in range(50)]
    assert all(read_header(b, TABLES).version == 3 for b in valid)
    outcomes = fuzz_decoder(valid, TABLES, rng, max_numel=64 * 48)
    assert outcomes["refused"] > 5000 and outcomes["decoded"] > 0, outcomes


def test_the_rate_term_rounds_straight_through_and_pulls_values_to_frequent_codes():
    term = RateTerm(STEPS)
    z = TRAIN[:8].clone().requires_grad_(True)
    rounded, bits = term(z)
    assert torch.equal(rounded.detach(), STEPS.dequantize(STEPS.quantize(z)))
    rounded.sum().backward()
    assert torch.equal(z.grad, torch.ones_like(z))  # straight through
    # one channel: most values at code 0, a few at code 10; a value at code 1 is pulled down
    steps = FixedSteps(np.array([1.0], dtype=np.float32), np.array([0], dtype=np.uint8), (1, 64))
    z = torch.zeros(1, 1, 64)
    z[0, 0, :4] = 10.0
    z[0, 0, 4] = 1.0
    z.requires_grad_(True)
    torch.manual_seed(0)
    _, bits = RateTerm(steps)(z)
    bits.backward()
    assert z.grad[0, 0, 4] > 0 and bits > 0  # descending the rate moves it toward code 0
    # the estimate is of the coder's order: within 30% of the real bytes of these codes
    real = len(encode(TRAIN, tables=TABLES)) - 16
    torch.manual_seed(0)
    assert abs(float(RateTerm(STEPS)(TRAIN)[1]) * len(TRAIN) / 8 - real) < 0.3 * real


def test_coarser_levels_widen_the_steps_and_configs_refuse_what_cannot_train():
    from edgetorch.split.bottlefit import BottleFitConfig
    from edgetorch.split.train import StageConfig

    coarse = FixedSteps.fit(TRAIN, levels=16)
    assert np.allclose(coarse.scale, STEPS.scale * 17, rtol=1e-6)  # 255 / 15 = 17 times the 8-bit step
    assert int(coarse.quantize(TRAIN).max()) <= 15 + 1  # the range spans codes 0..15 (rounding at the top)
    with pytest.raises(PayloadError, match="levels must be an int in 2..256"):
        FixedSteps.fit(TRAIN, levels=1)
    with pytest.raises(ValueError, match="freeze_encoder=False"):
        BottleFitConfig(rate_weight=1e-3, freeze_encoder=True)
    with pytest.raises(ValueError, match="freeze_encoder=False"):
        BottleFitConfig(rate_weight=0.0, stage2=None)
    with pytest.raises(ValueError, match="code_levels must be an int in 2..256"):
        BottleFitConfig(rate_weight=0.0, code_levels=300)
    with pytest.raises(ValueError, match="rate_weight applies to stage 2"):
        StageConfig(loss="ghnd", rate_weight=1e-3)
    with pytest.raises(ValueError, match="finite number >= 0"):
        StageConfig(loss="ce", rate_weight=-1.0)
    with pytest.raises(ValueError, match="give rate_weight too"):
        BottleFitConfig(code_levels=32)
    with pytest.raises(ValueError, match="finite number >= 0"):
        StageConfig(loss="ce", rate_weight=True)
    from edgetorch.cli.split import train
    from edgetorch.split.bottlefit import CODE_LEVELS

    import inspect
    assert inspect.signature(train).parameters["code_levels"].default.default == CODE_LEVELS  # the CLI's default
    names = [name for name, _ in BottleFitConfig(rate_weight=3e-4).stages()]
    assert names == ["stage1-ghnd", "stage2-ft-rate0.0003-levels16"]
    assert [name for name, _ in BottleFitConfig().stages()] == ["stage1-ghnd", "stage2-ft"]  # the paper's, unchanged
    # keys of stages trained before the rate term existed still match: rate_weight 0 is left out
    assert "rate_weight" not in StageConfig().identity() and StageConfig(loss="ce", rate_weight=1.0).identity()["rate_weight"] == 1.0


def test_a_diverging_bottleneck_reaches_the_loss_as_nan_not_an_index_error():
    z = TRAIN[:2].clone()
    z[0, 0, 0, 0] = float("nan")
    rounded, bits = RateTerm(STEPS)(z)
    assert torch.isnan(bits) and torch.isnan(rounded).any()  # the loop then reports TrainingDiverged


def test_a_resumed_rate_stage_rounds_with_the_steps_it_started_with(tmp_path):
    from edgetorch.split.bottlefit import STEPS_NAME, _stage_steps

    class Head(torch.nn.Module):
        def __init__(self, scale: float):
            super().__init__()
            self.scale = scale

        def forward(self, x):
            return x * self.scale

    class Student(torch.nn.Module):
        def __init__(self, scale: float):
            super().__init__()
            self.head, self.w = Head(scale), torch.nn.Parameter(torch.zeros(1))

    data = torch.utils.data.TensorDataset(TRAIN, torch.zeros(len(TRAIN), dtype=torch.long))
    first = _stage_steps(Student(1.0), data, 16, tmp_path / "stage2")
    assert (tmp_path / "stage2" / STEPS_NAME).is_file()
    again = _stage_steps(Student(2.0), data, 16, tmp_path / "stage2")  # a refit would differ: the file wins
    assert again.to_bytes() == first.to_bytes()
    (tmp_path / "stage2" / STEPS_NAME).write_text('{"scale": [1], "zero_point": [300], "sample_shape": [1]}')
    from edgetorch.weights import CheckpointError

    with pytest.raises(CheckpointError, match="zero points are integers"):
        _stage_steps(Student(1.0), data, 16, tmp_path / "stage2")
