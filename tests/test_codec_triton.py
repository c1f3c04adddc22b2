"""Triton codec kernels (codecs/_triton.py) against the CPU / torch reference, byte for byte.

Without a GPU the kernels run on CPU tensors under Triton's interpreter. ``TRITON_INTERPRET``
is read when ``@triton.jit`` decorates a kernel, i.e. when ``edgetorch.codecs._triton`` is first
imported in a process, so it cannot be switched on for one test module of a shared pytest run:
whichever module imported the kernels first would decide for all. So the interpreter tests run
in a child pytest process over this file with ``TRITON_INTERPRET=1`` in its environment from the
start (``test_kernels_under_interpreter``); in the parent they are skipped, and the parent runs
the compiled kernels on CUDA where a GPU exists. Running this file with ``TRITON_INTERPRET=1``
set by hand runs the interpreter tests in-process (useful with ``-k``).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

triton = pytest.importorskip("triton", reason="Triton is not installed (it ships with CUDA builds of torch)")

from edgetorch.codecs import _triton as T  # noqa: E402
from edgetorch.codecs.bitmap import pack_bits, pack_torch, unpack_torch, zero_limit_bits  # noqa: E402
from edgetorch.codecs.mask import MaskTensor, pack_mask  # noqa: E402
from edgetorch.codecs.topk import _topk_mask, pack_topk  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(
    not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child process of test_kernels_under_interpreter"
)
HYPO = settings(max_examples=25, deadline=None)
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
INT_OF = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32,
          torch.float64: torch.int64}
NAN, INF = float("nan"), float("inf")
SPECIALS = [0.0, -0.0, NAN, -NAN, INF, -INF, 1e-40, -1e-40, 5e-8, 3.0, -7.5]
TIES = [0.5, -0.5, 1.0, -1.0, 2.0, -2.0, 3.0, INF]  # few distinct magnitudes: many ties


def ints(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns (NaN compares equal to itself, -0.0 differs from +0.0)."""
    return t.contiguous().view(INT_OF[t.dtype])


def sample(shape: tuple[int, ...], dtype: torch.dtype, seed: int, zero_frac: float, tied: bool) -> torch.Tensor:
    """Random values (or values from a small pool, for ties), specials sprinkled, some exact zeros."""
    g = torch.Generator().manual_seed(seed)
    numel = math.prod(shape)
    if tied:
        x = torch.tensor(TIES, dtype=torch.float64)[torch.randint(0, len(TIES), (numel,), generator=g)]
    else:
        x = torch.randn(numel, generator=g, dtype=torch.float64)
    if numel:
        where = torch.randint(0, numel, (max(1, numel // 16),), generator=g)
        specials = torch.tensor(SPECIALS, dtype=torch.float64)
        x[where] = specials[torch.randint(0, len(SPECIALS), where.shape, generator=g)]
        x[torch.rand(numel, generator=g, dtype=torch.float64) < zero_frac] = 0.0
    return x.to(dtype).view(shape)


def parent_only(reason: str):
    return pytest.mark.skipif(INTERPRETED, reason=reason)


# --- the interpreter run ------------------------------------------------------------------------


@parent_only("this process already interprets the kernels")
def test_kernels_under_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = Path(__file__).resolve().parents[1]
    skip = ("test_kernels_under_interpreter", "test_every_kernel_compiles", "test_cuda", "test_import_edgetorch")
    cmd = [sys.executable, "-m", "pytest", str(Path(__file__).resolve()), "-o", "addopts=", "-q",
           "-p", "no:cacheprovider", "-k", " and ".join(f"not {name}" for name in skip)]
    run = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"interpreter tests failed:\n{run.stdout[-8000:]}\n{run.stderr[-2000:]}"
    assert " passed" in run.stdout and " skipped" not in run.stdout, run.stdout[-2000:]


@interpreted
def test_kernels_are_interpreted() -> None:
    # Guards the premise of every test below: the kernels run through the interpreter on CPU.
    assert type(T._compact_kernel).__name__ == "InterpretedFunction"


# --- golden bytes -------------------------------------------------------------------------------


@interpreted
def test_golden_bitmap_bytes() -> None:
    x = torch.tensor([0, 1.5, 0, 0, -2, 0, 0, 3, 0, 0, 4], dtype=torch.float32)
    bitmap, values = T.pack_bitmap(x.view(torch.int32), 0)
    assert bitmap.tolist() == [0b1001_0010, 0b0000_0100]
    assert values.view(torch.float32).tolist() == [1.5, -2.0, 3.0, 4.0]
    assert torch.equal(T.unpack_bitmap(bitmap, values.view(torch.float32), 11), x)


@interpreted
def test_golden_mask_bytes() -> None:
    x = torch.tensor([1.0, 0.0, 7.0, 3.0, -1.0, 5.9, 6.0, 0.1, 2.0])
    bitmap = T.pack_mask(x, 0.0, 6.0)
    assert bitmap.tolist() == [0b10101001, 0b00000001]
    assert T.unpack_mask(bitmap, 9, 3.0, 0.0, torch.float32).tolist() == [3, 0, 0, 3, 0, 3, 0, 3, 3]


@interpreted
def test_golden_topk_bytes() -> None:
    x = torch.tensor([[0.1, -3.0, 0.0, 2.0], [5.0, 5.0, 5.0, -1.0]])
    bitmap, values, counts = T.pack_topk_rows(x, 2)
    assert bitmap.tolist() == [0b00111010]
    assert values.tolist() == [[-3.0, 2.0], [5.0, 5.0]] and counts.tolist() == [2, 2]
    assert T.unpack_topk_rows(bitmap, values, 2, 4).tolist() == [[0, -3, 0, 2], [5, 5, 0, 0]]


# --- bitmap -------------------------------------------------------------------------------------


@interpreted
@HYPO
@given(
    dtype=st.sampled_from(DTYPES),
    n=st.integers(0, 600),
    block=st.sampled_from([16, 64, 256]),
    threshold=st.sampled_from([0.0, 0.0, 0.3, 1.0, 1e-40, INF]),
    zero_frac=st.sampled_from([0.0, 0.5, 0.9, 1.0]),
    seed=st.integers(0, 2**31),
)
def test_bitmap_matches_torch_reference(dtype, n, block, threshold, zero_frac, seed) -> None:
    x = sample((n,), dtype, seed, zero_frac, tied=False)
    bits, limit = ints(x), zero_limit_bits(dtype, threshold)
    ref_bitmap, ref_values = pack_torch(bits, limit)
    prefix = T.count(bits, limit, block=block)
    assert prefix.shape == (-(-n // block) + 1,) and int(prefix[-1]) == ref_values.numel()
    bitmap, values = T.compact(bits, limit, prefix, int(prefix[-1]), block=block)
    assert torch.equal(bitmap, ref_bitmap) and torch.equal(values, ref_values)
    assert torch.equal(T.pack_bitmap(bits, limit, block=block)[1], ref_values)
    dense = T.unpack_bitmap(bitmap, values.view(dtype), n, block=block)
    assert dense.dtype == dtype and torch.equal(ints(dense), unpack_torch(ref_bitmap, ref_values, n))


@interpreted
@pytest.mark.parametrize("dtype", DTYPES)
def test_bitmap_many_blocks_all_kept_and_none_kept(dtype) -> None:
    x = sample((3001,), dtype, 1, 0.0, tied=False)
    x[x == 0] = 1.0  # every element kept
    bits = ints(x)
    for limit in (0, T._ABS_MASK[bits.dtype]):  # all kept, then nothing (limit = absmask)
        ref_bitmap, ref_values = pack_torch(bits, limit)
        bitmap, values = T.pack_bitmap(bits, limit, block=512)
        assert torch.equal(bitmap, ref_bitmap) and torch.equal(values, ref_values)
        assert torch.equal(T.unpack_bitmap(bitmap, values, 3001, block=512), unpack_torch(bitmap, values, 3001))
    assert bitmap.tolist() == [0] * 376 and values.numel() == 0


@interpreted
def test_compact_with_a_short_nnz_drops_values_instead_of_writing_past_the_end() -> None:
    bits = torch.arange(1, 101, dtype=torch.int32)
    prefix = T.count(bits, 0, block=16)
    bitmap, values = T.compact(bits, 0, prefix, 10, block=16)
    assert values.tolist() == list(range(1, 11)) and bitmap.tolist() == [255] * 12 + [15]


@interpreted
def test_unpack_ignores_bits_beyond_the_values() -> None:
    bitmap = torch.tensor([0xFF, 0xFF], dtype=torch.uint8)  # 12 set bits, 3 values
    dense = T.unpack_bitmap(bitmap, torch.tensor([1, 2, 3], dtype=torch.int16), 12, block=8)
    assert dense.tolist() == [1, 2, 3] + [0] * 9


# --- top-k --------------------------------------------------------------------------------------


def cap_nans(x: torch.Tensor, keep: int) -> torch.Tensor:
    """At most ``keep`` NaNs per row, so the quota is met by distinct magnitudes or ties; rows with
    more NaNs than ``keep`` (the first NaNs are kept) have their own test below."""
    for row in x:
        nans = row.isnan().nonzero().flatten()
        row[nans[keep:]] = 2.0
    return x


@interpreted
@HYPO
@given(
    dtype=st.sampled_from(DTYPES),
    rows=st.integers(1, 4),
    n=st.integers(1, 300),
    keep_frac=st.sampled_from([0.0, 0.01, 0.1, 0.5, 0.9, 1.0]),
    block=st.sampled_from([16, 64, 256]),
    zero_frac=st.sampled_from([0.0, 0.3, 0.8, 1.0]),
    tied=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_topk_matches_pack_topk(dtype, rows, n, keep_frac, block, zero_frac, tied, seed) -> None:
    keep = round(keep_frac * n)
    sparsity = (n - keep) / n
    if keep == 0:  # pack_topk takes sparsity < 1: compare with the mask it is built on
        x = sample((rows, n), dtype, seed, zero_frac, tied)
        bitmap, values, counts = T.pack_topk_rows(x, 0, block=block)
        assert torch.equal(bitmap, pack_bits(_topk_mask(x, 0))) and values.shape == (rows, 0)
        assert counts.tolist() == [0] * rows
        return
    x = cap_nans(sample((rows, n), dtype, seed, zero_frac, tied), keep)
    ref = pack_topk(x, sparsity)
    assert ref.nnz == sum(min(keep, int(r.ne(0).sum())) for r in x)  # the quota is what we think
    bitmap, values, counts = T.pack_topk_rows(x, keep, block=block)
    assert torch.equal(bitmap, ref.bitmap)
    assert values.shape == (rows, keep) and values.dtype == dtype
    assert counts.tolist() == [min(keep, int(r.ne(0).sum())) for r in x]
    kept = torch.cat([values[r, : counts[r]] for r in range(rows)])
    assert torch.equal(ints(kept), ints(ref.values))
    assert all(ints(values[r, counts[r]:]).eq(0).all() for r in range(rows))  # zero padding
    dense = T.unpack_topk_rows(bitmap, values, rows, n, block=block)
    assert torch.equal(ints(dense), ints(ref.unpack().view(rows, n)))


@interpreted
@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_rows_spanning_blocks_and_bytes(dtype) -> None:
    # 999 columns: rows start mid-byte and mid-block; ties on row 1 straddle chunk boundaries.
    x = sample((3, 999), dtype, 2, 0.3, tied=False)
    x[1, 100:700] = 1.5
    x[2] = 0.0
    x[2, 5] = -4.0
    keep = 150
    ref = pack_topk(x, (999 - keep) / 999)
    bitmap, values, counts = T.pack_topk_rows(x, keep, block=256)
    assert torch.equal(bitmap, ref.bitmap) and counts.tolist() == [150, 150, 1]
    kept = torch.cat([values[r, : counts[r]] for r in range(3)])
    assert torch.equal(ints(kept), ints(ref.values))
    assert torch.equal(ints(T.unpack_topk_rows(bitmap, values, 3, 999, block=256)), ints(ref.unpack()))


@interpreted
def test_topk_keep_above_n_keeps_every_nonzero() -> None:
    x = torch.tensor([[0.0, -1.0, NAN, 0.0, 2.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    bitmap, values, counts = T.pack_topk_rows(x, 7, block=8)
    ref = _topk_mask(x, 7)
    assert torch.equal(bitmap, pack_bits(ref))
    assert values.shape == (2, 5) and counts.tolist() == [3, 0]  # width min(keep, n)
    assert torch.equal(ints(values[0, :3]), ints(x[ref]))


@interpreted
def test_more_nans_than_keep_keeps_the_first_nans_only() -> None:
    # NaN is the largest magnitude and ties are taken by position, like any other value: the
    # quota holds (a float comparison would make the threshold NaN and keep the zero too).
    x = torch.tensor([[NAN, NAN, 0.0, 1.0, 2.0]])
    bitmap, values, counts = T.pack_topk_rows(x, 1, block=8)
    assert bitmap.tolist() == [0b00001] and counts.tolist() == [1] and values.isnan().all()


@interpreted
def test_topk_empty_inputs() -> None:
    for rows, n, keep in ((3, 0, 0), (3, 0, 5), (0, 4, 2), (2, 5, 0)):
        bitmap, values, counts = T.pack_topk_rows(torch.ones(rows, n), keep, block=8)
        assert bitmap.numel() == (rows * n + 7) // 8 and not bitmap.any()
        assert values.shape == (rows, min(keep, n)) and counts.tolist() == [0] * rows
        assert T.unpack_topk_rows(bitmap, values, rows, n, block=8).eq(0).all()


# --- mask ---------------------------------------------------------------------------------------

BOUNDS = [(0.0, INF), (0.0, 6.0), (-1.0, 1.0), (0.1, 1 / 3), (-0.0, 0.9999), (-INF, 0.0), (5e-8, INF),
          (1e-40, 2.0)]


@interpreted
@HYPO
@given(
    dtype=st.sampled_from(DTYPES),
    n=st.integers(0, 600),
    block=st.sampled_from([16, 64, 256]),
    bounds=st.sampled_from(BOUNDS),
    seed=st.integers(0, 2**31),
)
def test_mask_matches_pack_mask(dtype, n, block, bounds, seed) -> None:
    low, high = bounds
    x = sample((n,), dtype, seed, 0.3, tied=False)
    x[::7] = torch.tensor([1.0, 1 / 3, 0.1, 6.0, 0.9999, 5e-8], dtype=dtype).repeat(n // 42 + 1)[: len(x[::7])]
    inside = high - 1e-9 if math.isinf(low) else (low + 1 if math.isinf(high) else (low + high) / 2)
    ref = pack_mask(x, low, high, inside=inside)
    bitmap = T.pack_mask(x, low, high, block=block)
    # The torch-op predicate of mask.py first (it is the definition: with an infinite high, +inf
    # is inside), then the CPU path, which may run its own kernel.
    assert torch.equal(bitmap, pack_bits(x > low if math.isinf(high) else (x > low) & (x < high)))
    assert torch.equal(bitmap, ref.bitmap), "mask.pack_mask's CPU path differs from its torch predicate"
    dense = T.unpack_mask(bitmap, n, ref.inside, ref.outside, dtype, block=block)
    assert torch.equal(ints(dense), ints(MaskTensor(ref.bitmap, (n,), dtype, ref.inside, ref.outside).unpack()))


@interpreted
def test_mask_with_nan_bound_is_empty() -> None:
    assert T.pack_mask(torch.ones(10), NAN).tolist() == [0, 0]


# --- arguments (no kernel runs) -----------------------------------------------------------------


def test_bad_arguments_are_rejected_with_a_reason() -> None:
    bits = torch.zeros(10, dtype=torch.int32)
    with pytest.raises(ValueError, match="power of two"):
        T.count(bits, 0, block=48)
    with pytest.raises(ValueError, match="limit"):
        T.count(bits, -1)
    with pytest.raises(TypeError, match="int16/int32/int64"):
        T.count(bits.float(), 0)
    with pytest.raises(ValueError, match="prefix"):
        T.compact(bits, 0, torch.zeros(5, dtype=torch.int64), 0, block=8)
    with pytest.raises(ValueError, match="bytes"):
        T.unpack_bitmap(torch.zeros(3, dtype=torch.uint8), bits, 10)
    with pytest.raises(ValueError, match="keep"):
        T.pack_topk_rows(torch.ones(2, 3), -1)
    with pytest.raises(ValueError, match="2-D"):
        T.pack_topk_rows(torch.ones(6), 1)
    with pytest.raises(TypeError, match="float16"):
        T.pack_mask(torch.ones(3, dtype=torch.int8), 0.0)


def test_import_edgetorch_does_not_import_triton() -> None:
    code = "import sys, edgetorch, edgetorch.codecs; sys.exit('triton' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# --- compiled kernels ---------------------------------------------------------------------------


def compile_variants():
    """(kernel, pointer types, constexprs) for every kernel variant the module launches."""
    for ints_, mask in (("i16", 0x7FFF), ("i32", 0x7FFF_FFFF), ("i64", 0x7FFF_FFFF_FFFF_FFFF)):
        data = {"src_ptr": "*" + ints_, "bits_ptr": "*" + ints_, "values_ptr": "*" + ints_, "out_ptr": "*" + ints_}
        for mode in (T._THRESHOLD, T._TOPK):
            for kernel in (T._count_kernel, T._row_start_kernel, T._compact_kernel):
                yield kernel, data, {"ABS_MASK": mask, "MODE": mode}
        for rows in (False, True):
            yield T._scatter_kernel, data, {"ROWS": rows}
        for kernel in (T._radix_hist_kernel, T._tie_count_kernel, T._tie_cut_kernel):
            yield kernel, data, {"ABS_MASK": mask}
        for has_high in (False, True):
            yield T._mask_pack_kernel, data, {"ABS_MASK": mask, "HAS_HIGH": has_high}
        yield T._mask_unpack_kernel, data, {}
    for kernel in (T._count_kernel, T._row_start_kernel):
        yield kernel, {"src_ptr": "*u8"}, {"ABS_MASK": 0, "MODE": T._BITMAP}
    for last in (False, True):
        yield T._radix_select_kernel, {}, {"LAST": last}


@parent_only("the interpreter does not compile")
def test_every_kernel_compiles_for_sm90() -> None:
    # The interpreter runs the kernels' semantics on numpy; it does not lower them. This compiles
    # each variant to a cubin for an H100 (sm_90) with Triton's own ptxas, no GPU needed, so an
    # op that has no GPU lowering (or a type error only the compiler sees) fails here.
    compiler = pytest.importorskip("triton.compiler")
    from triton.backends.compiler import GPUTarget

    if not hasattr(compiler, "ASTSource"):
        pytest.skip("this Triton has no triton.compiler.ASTSource")
    kernels = {name for name in dir(T) if name.endswith("_kernel")}
    seen = set()
    for kernel, pointers, constexprs in compile_variants():
        seen.add(kernel.fn.__name__)
        constexprs = {**constexprs, "BLOCK": T.BLOCK} if "BLOCK" in kernel.arg_names else constexprs
        signature = {}
        for name in kernel.arg_names:
            if name in constexprs:
                signature[name] = "constexpr"
            elif name.endswith("_ptr"):
                signature[name] = pointers.get(name, {"bitmap_ptr": "*u8", "hist_ptr": "*i32"}.get(name, "*i64"))
            else:
                signature[name] = "i64"
        src = compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
        assert "cubin" in triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm
    assert seen == kernels


# --- compiled kernels on a GPU ------------------------------------------------------------------


@parent_only("checks the compiled kernels, not the interpreter")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_kernels_match_the_cpu_reference_without_syncs(dtype) -> None:
    rows, n, keep = 5, 70_001, 7_000  # many blocks of the default size, rows start mid-byte
    x = sample((rows, n), dtype, 3, 0.4, tied=dtype in (torch.float16, torch.bfloat16))
    x[1, :40_000] = 1.25  # ties at the threshold across many chunks
    x[2] = 0.0
    x = cap_nans(x, keep)
    xc = x.cuda()
    flat, flat_c = ints(x).view(-1), ints(xc).view(-1)
    limit = zero_limit_bits(dtype, 0.5)
    torch.cuda.set_sync_debug_mode("error")  # any host sync below raises
    try:
        prefix = T.count(flat_c, limit)
        bitmap_c, values_c, counts_c = T.pack_topk_rows(xc, keep)
        dense_c = T.unpack_topk_rows(bitmap_c, values_c, rows, n)
        mask_c = T.pack_mask(xc.view(-1), 0.0, 6.0)
        unmask_c = T.unpack_mask(mask_c, x.numel(), 3.0, 0.0, dtype)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    nnz = int(prefix[-1])  # the one sync of bitmap packing
    bm_c, vals_c = T.compact(flat_c, limit, prefix, nnz)
    ref_bm, ref_vals = pack_torch(flat, limit)
    assert torch.equal(bm_c.cpu(), ref_bm) and torch.equal(vals_c.cpu(), ref_vals)
    torch.cuda.set_sync_debug_mode("error")
    try:
        unpacked_c = T.unpack_bitmap(bm_c, vals_c, flat.numel())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(unpacked_c.cpu(), unpack_torch(ref_bm, ref_vals, flat.numel()))

    ref = pack_topk(x, (n - keep) / n)
    counts = counts_c.cpu()
    assert torch.equal(bitmap_c.cpu(), ref.bitmap) and counts.tolist() == [keep, keep, 0, keep, keep]
    kept = torch.cat([values_c.cpu()[r, : counts[r]] for r in range(rows)])
    assert torch.equal(ints(kept), ints(ref.values))
    assert torch.equal(ints(dense_c.cpu()), ints(ref.unpack()))
    ref_mask = pack_mask(x, 0.0, 6.0, inside=3.0)
    assert torch.equal(mask_c.cpu(), ref_mask.bitmap)
    assert torch.equal(ints(unmask_c.cpu()), ints(ref_mask.unpack().view(-1)))


# --- the codecs' GPU path, wired to the kernels -------------------------------------------------


@interpreted
def test_codecs_and_engine_take_the_kernel_path_with_the_same_results(monkeypatch) -> None:
    """Every codec routed through the kernels (as on CUDA) gives the CPU path's bytes, and a Back
    Razor step through the engine gives the CPU path's gradients."""
    import copy

    import torch.nn.functional as F
    from torch import nn

    import edgetorch as et
    from edgetorch.codecs import _cpu_kernels, _cuda
    from edgetorch.codecs.bitmap import pack_bitmap_if_smaller
    from edgetorch.codecs.topk import TopkRowsTensor

    torch.manual_seed(0)
    x = torch.relu(torch.randn(6, 700))
    x[2] = 0.0  # a row with fewer non-zeros than its quota
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 8, 3),
                          nn.ReLU(), nn.Flatten(), nn.Linear(8 * 14 * 14, 4))
    images, labels = torch.randn(2, 3, 32, 32), torch.tensor([1, 3])

    def step():
        net = copy.deepcopy(model)
        ledger = et.SavedTensorLedger()
        with et.compress_activations(net, et.BackRazor(0.9), ledger=ledger):
            loss = F.cross_entropy(net(images), labels)
        loss.backward()
        return [p.grad for p in net.parameters()], ledger

    ref_top, ref_bits, ref_mask = pack_topk(x, 0.9), et.pack_bitmap(x), pack_mask(x, 0.0)
    ref_grads, ref_ledger = step()

    monkeypatch.setattr(_cuda, "kernels", lambda t: T)  # every tensor takes the GPU path
    monkeypatch.setattr(_cpu_kernels, "NATIVE", False)
    top = pack_topk(x, 0.9)
    assert isinstance(top, TopkRowsTensor)
    assert torch.equal(top.bitmap, ref_top.bitmap) and top.nnz == ref_top.nnz
    assert torch.equal(top.unpack(), ref_top.unpack())
    assert top.nbytes == top.bitmap.numel() + 4 * top.values.numel() + 8 * 6
    bits = et.pack_bitmap(x)
    assert torch.equal(bits.bitmap, ref_bits.bitmap) and torch.equal(bits.values, ref_bits.values)
    assert torch.equal(bits.unpack(), x)
    small = pack_bitmap_if_smaller(x, 0.0, None, x.numel() * 4)
    assert torch.equal(small.bitmap, ref_bits.bitmap) and torch.equal(small.unpack(), x)
    assert pack_bitmap_if_smaller(x, 0.0, None, ref_bits.nbytes) is None  # not smaller than the bound
    mask = pack_mask(x, 0.0)
    assert torch.equal(mask.bitmap, ref_mask.bitmap) and torch.equal(mask.unpack(), ref_mask.unpack())

    grads, ledger = step()
    assert all(torch.equal(a, b) for a, b in zip(ref_grads, grads))
    assert any(r.form == "prune" for r in ledger.records)
    assert ledger.total().nnz == ref_ledger.total().nnz
