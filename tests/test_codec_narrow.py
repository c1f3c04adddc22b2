"""Integer narrowing: wide integer tensors (max-pool indices) stored in the smallest integer
dtype that holds their range, losslessly."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from edgetorch.codecs.narrow import pack_narrow


@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(st.integers(-(2**62), 2**62), min_size=1, max_size=200),
    dtype=st.sampled_from([torch.int16, torch.int32, torch.int64]),
)
def test_roundtrip_is_exact_and_never_larger(values, dtype):
    info = torch.iinfo(dtype)
    t = torch.tensor([min(max(v, info.min), info.max) for v in values], dtype=dtype)
    packed = pack_narrow(t)
    fits = [d for d in (torch.int8, torch.int16, torch.int32)
            if torch.iinfo(d).min <= t.min() and t.max() <= torch.iinfo(d).max and d.itemsize < dtype.itemsize]
    if not fits:
        assert packed is None  # nothing narrower holds the range: kept as it is
        return
    assert packed.values.dtype == fits[0]
    back = packed.unpack()
    assert back.dtype == dtype and torch.equal(back, t)
    assert packed.nbytes == t.numel() * packed.values.element_size() < t.numel() * t.element_size()


@pytest.mark.parametrize("high, stored", [(127, torch.int8), (128, torch.int16), (32767, torch.int16),
                                          (32768, torch.int32), (2**31 - 1, torch.int32)])
def test_smallest_dtype_that_holds_the_range(high, stored):
    t = torch.tensor([[0, high], [-1, 5]], dtype=torch.int64)
    packed = pack_narrow(t)
    assert packed.values.dtype == stored and packed.shape == t.shape
    assert torch.equal(packed.unpack(), t)


def test_max_pool_indices_shrink_to_a_quarter_or_less():
    _, indices = torch.nn.functional.max_pool2d(torch.randn(2, 3, 112, 112), 2, return_indices=True)
    packed = pack_narrow(indices)
    assert packed.values.dtype == torch.int16 and packed.nbytes * 4 == indices.numel() * 8
    assert torch.equal(packed.unpack(), indices)


def test_non_contiguous_and_empty_and_out_of_range():
    t = torch.arange(64, dtype=torch.int64).reshape(8, 8).t()
    assert torch.equal(pack_narrow(t).unpack(), t)
    assert pack_narrow(torch.zeros(0, dtype=torch.int64)) is None
    assert pack_narrow(torch.tensor([2**40], dtype=torch.int64)) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8, torch.uint8, torch.bool])
def test_rejects_what_it_does_not_narrow(dtype):
    with pytest.raises(TypeError, match="int16, int32 or int64"):
        pack_narrow(torch.zeros(4, dtype=dtype))


def test_a_known_bound_chooses_the_dtype_without_reading_the_values():
    t = torch.tensor([0, 5, 300], dtype=torch.int64)
    assert pack_narrow(t, bound=32767).values.dtype == torch.int16  # 300 fits either way
    assert pack_narrow(t, bound=40000).values.dtype == torch.int32  # the bound decides, not the values
    assert torch.equal(pack_narrow(t, bound=1000).unpack(), t)
    with pytest.raises(ValueError, match="bound must be an int >= 0"):
        pack_narrow(t, bound=-1)
    for bad in (1.5, True, "7"):
        with pytest.raises(TypeError, match="bound must be an int >= 0"):
            pack_narrow(t, bound=bad)


def test_max_pool_indices_get_their_plane_size_as_bound_under_back_razor():
    import edgetorch as et
    from torch import nn

    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(4 * 32 * 32, 2))
    ledger = et.SavedTensorLedger()
    with et.compress_activations(model, et.BackRazor(0.9), ledger=ledger):
        out = model(torch.randn(2, 3, 64, 64)).sum()
    out.backward()
    (idx,) = [r for r in ledger.records if r.dtype == "int64"]
    assert idx.stored_bytes * 4 == idx.dense_bytes  # positions in a 64x64 plane: int16
