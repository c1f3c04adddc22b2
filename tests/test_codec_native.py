"""The C extension behind the CPU codecs (codecs/_native.c): byte for byte against torch ops.

Every kernel is checked against the torch-ops path the codecs fall back to without the extension
(``_cpu_kernels.torch_ops()``), on every instruction set this CPU runs (the portable C loops
included), across chunk boundaries, on several threads, and after fork. Also: the fallback
itself, its one-time warning, and what importing edgetorch and a first pack cost a fresh process.
"""

from __future__ import annotations

import contextlib
import json
import math
import multiprocessing
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from edgetorch import pack_bitmap
from edgetorch.measure.footprint import first_call_footprint
from edgetorch.codecs import FLOAT_DTYPES, _backend, _cpu_kernels
from edgetorch.codecs._cpu_kernels import torch_ops
from edgetorch.codecs.bitmap import BitmapTensor, pack_bits, unpack_bits
from edgetorch.codecs.mask import MaskTensor, pack_mask
from edgetorch.codecs.narrow import pack_narrow
from edgetorch.codecs.topk import _topk_mask, kept_per_row, pack_topk

needs_native = pytest.mark.skipif(not _cpu_kernels.NATIVE, reason="the C extension is not built")
ISAS = _cpu_kernels._native.isa_available() if _cpu_kernels.NATIVE else ()
CHUNK = _cpu_kernels.CHUNK_ELEMS
INT_OF = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
          torch.bfloat16: torch.int16}
SPECIALS = [0.0, -0.0, float("nan"), float("inf"), float("-inf"), 1e-40, -1e-40, 6.0, -6.0, 1.0, 0.5]
HYPO = settings(max_examples=40, deadline=None)


@contextlib.contextmanager
def isa(name: str):
    """Run the extension's kernels for one instruction set."""
    saved = _cpu_kernels._native.isa()
    _cpu_kernels._native.set_isa(name)
    try:
        yield
    finally:
        _cpu_kernels._native.set_isa(saved)


@contextlib.contextmanager
def threads(n: int):
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def ints(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(INT_OF[x.dtype]) if x.dtype in INT_OF else x


def same_packed(a: BitmapTensor, b: BitmapTensor) -> bool:
    return (torch.equal(a.bitmap, b.bitmap) and a.values.dtype == b.values.dtype
            and torch.equal(ints(a.values), ints(b.values)) and a.shape == b.shape and a.dtype == b.dtype)


def sample(n: int, dtype: torch.dtype, zero_frac: float, seed: int, choices: list[float] | None = None) -> torch.Tensor:
    """Random values (or draws from ``choices``, for ties) with specials and exact zeros."""
    g = torch.Generator().manual_seed(seed)
    if choices:
        x = torch.tensor(choices, dtype=torch.float64)[torch.randint(0, len(choices), (n,), generator=g)]
    else:
        x = torch.randn(n, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-3, 4, (n,), generator=g)
    if n:
        where = torch.randint(0, n, (max(1, n // 32),), generator=g)
        x[where] = torch.tensor(SPECIALS, dtype=torch.float64)[torch.randint(0, len(SPECIALS), where.shape, generator=g)]
        x[torch.rand(n, generator=g, dtype=torch.float64) < zero_frac] = 0.0
    return x.to(dtype)


isa_param = pytest.mark.parametrize("isa_name", ISAS or ["none"])

# --- bitmap ---------------------------------------------------------------------------------------


def check_bitmap(x: torch.Tensor, threshold: float = 0.0) -> None:
    got = pack_bitmap(x, threshold)
    with torch_ops():
        ref = pack_bitmap(x, threshold)
        ref_dense = ref.unpack()
    assert same_packed(got, ref)
    assert torch.equal(ints(got.unpack()), ints(ref_dense))


@needs_native
@isa_param
@HYPO
@given(dtype=st.sampled_from(FLOAT_DTYPES), n=st.integers(0, 2100), zero_frac=st.floats(0, 1),
       threshold=st.sampled_from([0.0, 0.0, 1e-3, 0.5, 3.0, math.inf]), seed=st.integers(0, 2**31))
def test_bitmap_matches_torch_ops(isa_name, dtype, n, zero_frac, threshold, seed) -> None:
    with isa(isa_name):
        check_bitmap(sample(n, dtype, zero_frac, seed), threshold)


@needs_native
@isa_param
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("n", [CHUNK - 3, CHUNK + 9, 5 * CHUNK + 17])
@pytest.mark.parametrize("pattern", ["random", "zero_tail", "zero_head", "all_zero", "all_kept"])
def test_bitmap_across_chunks_and_threads(isa_name, dtype, n, pattern) -> None:
    x = sample(n, dtype, 0.5, seed=n)
    if pattern == "zero_tail":
        x[n // 3:] = 0
    elif pattern == "zero_head":
        x[: n - 100] = 0
    elif pattern == "all_zero":
        x.zero_()
    elif pattern == "all_kept":
        x[x == 0] = 1.0
    with isa(isa_name), threads(4):  # 4 threads on any machine: the pool's hand-offs are exercised
        check_bitmap(x)
        check_bitmap(x[1:])  # an odd start: misaligned loads, a partial last byte


@needs_native
def test_unpack_rejects_a_bitmap_that_does_not_match_its_values() -> None:
    p = pack_bitmap(torch.tensor([1.0, 0.0, 2.0]))
    with pytest.raises(ValueError, match="2 bits set but there are 1 values"):
        BitmapTensor(p.bitmap, p.values[:1], p.shape, p.dtype).unpack()
    with pytest.raises(ValueError, match="has 1 bytes, got 2"):
        BitmapTensor(torch.zeros(2, dtype=torch.uint8), p.values[:0], p.shape, p.dtype).unpack()
    # bits beyond the last element are not elements: ignored, not read as values
    q = BitmapTensor(torch.tensor([0b1111_1101], dtype=torch.uint8), p.values, p.shape, p.dtype)
    assert q.unpack().tolist() == [1.0, 0.0, 2.0]


# --- bool bitmaps ---------------------------------------------------------------------------------


@needs_native
@isa_param
@HYPO
@given(n=st.integers(0, 3000), frac=st.floats(0, 1), seed=st.integers(0, 2**31))
def test_bits_match_torch_ops(isa_name, n, frac, seed) -> None:
    mask = torch.rand(n, generator=torch.Generator().manual_seed(seed)) < frac
    with isa(isa_name):
        bits = pack_bits(mask)
        with torch_ops():
            ref = pack_bits(mask)
            assert torch.equal(unpack_bits(ref, n), mask)
        assert torch.equal(bits, ref)
        assert torch.equal(unpack_bits(bits, n), mask)
        assert torch.equal(pack_bits(mask.view(-1, 1).expand(n, 2).t()), pack_bits(mask.repeat(2)))  # strided


# --- per-row top-k --------------------------------------------------------------------------------


def check_topk(x: torch.Tensor, sparsity: float, rows: int) -> None:
    got = pack_topk(x, sparsity, rows=rows)
    with torch_ops():
        ref = pack_topk(x, sparsity, rows=rows)
        ref_dense = ref.unpack()
    assert same_packed(got, ref), "bitmap or values differ from the torch-ops top-k"
    assert torch.equal(ints(got.unpack()), ints(ref_dense))
    keep = kept_per_row(x.numel() // rows, sparsity)
    flat = x.reshape(rows, -1)
    expected = torch.minimum((ints(flat) & ((1 << (8 * x.element_size() - 1)) - 1) != 0).sum(1),
                             torch.tensor(keep))
    assert got.nnz == int(expected.sum())  # exactly the quota, or every non-zero when fewer


@needs_native
@isa_param
@HYPO
@given(dtype=st.sampled_from(FLOAT_DTYPES), rows=st.integers(1, 5), rowlen=st.integers(0, 700),
       sparsity=st.sampled_from([0.0, 0.1, 0.5, 0.9, 0.99, 0.999]), zero_frac=st.floats(0, 1),
       ties=st.booleans(), seed=st.integers(0, 2**31))
def test_topk_matches_torch_ops(isa_name, dtype, rows, rowlen, sparsity, zero_frac, ties, seed) -> None:
    choices = [0.5, -0.5, 1.0, 2.0, -2.0, float("nan"), float("inf")] if ties else None
    x = sample(rows * rowlen, dtype, zero_frac, seed, choices)
    with isa(isa_name):
        check_topk(x, sparsity, rows)


@needs_native
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("rows, rowlen", [(1, 3 * CHUNK + 5), (3, 20_011), (16, 9_000), (64, 7)])
def test_topk_long_rows_across_chunks_and_threads(dtype, rows, rowlen) -> None:
    # rows of >= 16384 elements take the 11-bit radix digits; rows end mid-byte and mid-chunk
    with threads(4):
        for ties in (False, True):
            x = sample(rows * rowlen, dtype, 0.3, seed=rowlen, choices=[1.0, -1.0, 3.0, 0.25] if ties else None)
            check_topk(x.view(rows, rowlen), 0.9, rows)


def _adversarial_row(kind: str, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    if kind == "ties":  # many keys equal to the threshold, few distinct values
        x = torch.tensor([0.5, -1.0, 1.0, 2.0, 0.0])[torch.randint(0, 5, (n,), generator=g)].double()
    elif kind == "equal":
        x = torch.full((n,), -3.0, dtype=torch.float64)
    elif kind == "huge":  # a few huge values the strided sample never sees
        x[torch.randint(0, n, (n // 50,), generator=g)] = 1e30
    elif kind == "naninf":
        x[torch.randint(0, n, (n // 5,), generator=g)] = float("nan")
        x[torch.randint(0, n, (n // 7,), generator=g)] = -float("inf")
    elif kind == "zeros":  # mostly zeros: the threshold is zero
        x[torch.rand(n, generator=g) < 0.97] = 0.0
    elif kind == "ascending":
        x = x.abs().sort().values
    elif kind == "descending":
        x = -x.abs().sort(descending=True).values
    elif kind == "stripes":  # the strided sample lands on a periodic pattern
        x = torch.where(torch.arange(n) % 64 == 32, x * 1e6, x)
    elif kind == "relu":
        x = x.relu()
    return x.to(dtype)


@needs_native
@isa_param
@settings(max_examples=12, deadline=None)
@given(dtype=st.sampled_from(FLOAT_DTYPES), rows=st.integers(1, 3), rowlen=st.integers(8192, 40_000),
       kind=st.sampled_from(["randn", "ties", "equal", "huge", "naninf", "zeros", "ascending", "descending",
                             "stripes", "relu"]),
       sparsity=st.sampled_from([0.5, 0.9, 0.99, 0.999]), seed=st.integers(0, 2**31))
def test_topk_long_rows_sampled_bracket_matches_reference(isa_name, dtype, rows, rowlen, kind, sparsity,
                                                          seed) -> None:
    # rows of >= 8192 elements first try a bracket found on a strided sample of the row (exact
    # select among the keys inside it, the whole-row radix select when the sample misled); the
    # distributions here make the sample mislead or the bracket overflow
    x = torch.stack([_adversarial_row(kind, rowlen, dtype, seed + r) for r in range(rows)])
    with isa(isa_name):
        check_topk(x, sparsity, rows)
        keep = kept_per_row(rowlen, sparsity)
        got = _cpu_kernels.topk(x, rows, keep)
    assert torch.equal(got[0], pack_bits(_topk_mask(x, keep).reshape(-1)))


def brute_topk_mask(x: torch.Tensor, keep: int) -> torch.Tensor:
    """Per row, the first ``keep`` non-zeros in order of decreasing magnitude bits, then position."""
    a = (x.view(INT_OF[x.dtype]) & torch.iinfo(INT_OF[x.dtype]).max).tolist()
    mask = torch.zeros(x.shape, dtype=torch.bool)
    for r, row in enumerate(a):
        order = sorted((i for i, v in enumerate(row) if v), key=lambda i: (-row[i], i))
        mask[r, order[:keep]] = True
    return mask


def test_topk_reference_agrees_with_brute_force() -> None:
    x = sample(40 * 300, torch.float32, 0.2, seed=3, choices=[0.5, 1.0, -1.0, 2.0, 4.0]).view(40, 300)
    for keep in (0, 1, 17, 150, 299, 300, 301):
        assert torch.equal(_topk_mask(x, keep), brute_topk_mask(x, keep))


@needs_native
def test_topk_more_nans_than_keep_keeps_the_first_nans() -> None:
    x = torch.tensor([[float("nan"), float("nan"), 0.0, 1.0, 2.0]])
    p = pack_topk(x, 0.8)  # keep 1
    assert p.bitmap.tolist() == [0b00001] and p.values.isnan().all() and p.nnz == 1


# --- mask -----------------------------------------------------------------------------------------

BOUNDS = [(0.0, math.inf, 1.0, 0.0), (0.0, 6.0, 3.0, 0.0), (-1.0, 1.0, 0.0, -1.0), (0.1, 1 / 3, 0.2, 0.1),
          (-0.0, 0.9999, 0.5, 0.0), (-math.inf, 0.0, -1.0, 0.0), (5e-8, math.inf, 1.0, 0.0),
          (1e-40, 2.0, 1.0, 0.0), (0.0, 1e10, 1.0, 0.0)]


@needs_native
@isa_param
@HYPO
@given(dtype=st.sampled_from(FLOAT_DTYPES), n=st.integers(0, 2100), bounds=st.sampled_from(BOUNDS),
       seed=st.integers(0, 2**31))
def test_mask_matches_torch_ops(isa_name, dtype, n, bounds, seed) -> None:
    low, high, inside, outside = bounds
    x = sample(n, dtype, 0.2, seed, choices=[low, high, inside, -inside, 1e-8, 6.0, 1.0, 0.1000001, 1e5, 7e4]
               if seed % 2 else None)
    with isa(isa_name):
        got = pack_mask(x, low, high, inside=inside, outside=outside)
        with torch_ops():
            ref = pack_mask(x, low, high, inside=inside, outside=outside)
            ref_dense = ref.unpack()
        assert torch.equal(got.bitmap, ref.bitmap)
        assert torch.equal(ints(got.unpack()), ints(ref_dense))


@needs_native
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_mask_across_chunks_and_threads(dtype) -> None:
    x = sample(5 * CHUNK + 3, dtype, 0.2, seed=9)
    with threads(4):
        for low, high, inside, outside in BOUNDS[:3]:
            got = pack_mask(x[1:], low, high, inside=inside, outside=outside)
            with torch_ops():
                ref = pack_mask(x[1:], low, high, inside=inside, outside=outside)
                ref_dense = ref.unpack()
            assert torch.equal(got.bitmap, ref.bitmap)
            assert torch.equal(ints(got.unpack()), ints(ref_dense))


@needs_native
def test_mask_reads_back_the_sign_of_zero_it_was_given() -> None:
    # 0.0 == -0.0, so a cache of bit patterns keyed by value alone returns whichever came first,
    # and (1.0, -0.0) compares equal to the ReLU mask's (1.0, 0.0)
    for inside in (1.0, 2.0):
        for outside in (-0.0, 0.0, -0.0):
            m = pack_mask(torch.tensor([1.0, -1.0]), -0.0, inside=inside, outside=outside)
            with torch_ops():
                ref = m.unpack()
            assert torch.equal(ints(m.unpack()), ints(ref))
            assert math.copysign(1.0, m.unpack()[1].item()) == math.copysign(1.0, outside)  # the sign is kept


@needs_native
def test_mask_unpack_rejects_a_short_bitmap() -> None:
    with pytest.raises(ValueError, match="need a bitmap of 2 bytes, got 1"):
        MaskTensor(torch.zeros(1, dtype=torch.uint8), torch.Size([9]), torch.float32, 1.0, 0.0).unpack()


# --- integer narrowing ----------------------------------------------------------------------------


@needs_native
@isa_param
@HYPO
@given(dtype=st.sampled_from([torch.int16, torch.int32, torch.int64]), n=st.integers(1, 3000),
       bits=st.integers(1, 63), seed=st.integers(0, 2**31))
def test_narrow_matches_torch_ops(isa_name, dtype, n, bits, seed) -> None:
    info = torch.iinfo(dtype)
    bound = min(2 ** min(bits, 62), info.max)
    t = torch.randint(-bound, bound, (n,), dtype=torch.int64, generator=torch.Generator().manual_seed(seed))
    t = t.clamp(info.min, info.max).to(dtype)
    with isa(isa_name):
        got = pack_narrow(t)
        with torch_ops():
            ref = pack_narrow(t)
        assert (got is None) == (ref is None)
        if got is not None:
            assert got.values.dtype == ref.values.dtype and torch.equal(got.values, ref.values)
            assert torch.equal(got.unpack(), t) and got.unpack().dtype == dtype


@needs_native
@pytest.mark.parametrize("src", [torch.int8, torch.int16, torch.int32, torch.int64])
@pytest.mark.parametrize("dst", [torch.int8, torch.int16, torch.int32, torch.int64])
def test_convert_every_width_across_chunks(src, dst) -> None:
    lo, hi = max(torch.iinfo(src).min, torch.iinfo(dst).min), min(torch.iinfo(src).max, torch.iinfo(dst).max)
    t = torch.randint(lo, hi, (3 * CHUNK + 7,), dtype=torch.int64).to(src)
    t[:2] = torch.tensor([lo, hi])
    with threads(4):
        assert torch.equal(_cpu_kernels.convert(t, dst), t.to(dst))
        if src != torch.int8:
            assert _cpu_kernels.minmax(t[1:]) == (int(t[1:].min()), int(t[1:].max()))


# --- threads, fork, concurrency -------------------------------------------------------------------


@needs_native
def test_concurrent_callers_get_their_own_results() -> None:
    # a second caller finds the pool busy and works alone; both must be right
    xs = [sample(4 * CHUNK + i, torch.float32, 0.5, seed=i) for i in range(6)]
    refs = [pack_bitmap(x) for x in xs]
    dense = [ints(r.unpack()) for r in refs]
    topks = [pack_topk(x, 0.9, rows=1) for x in xs]
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for _ in range(20):
                p = pack_bitmap(xs[i])
                assert same_packed(p, refs[i]) and torch.equal(ints(p.unpack()), dense[i])
                assert same_packed(pack_topk(xs[i], 0.9, rows=1), topks[i])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    with threads(2):
        workers = [threading.Thread(target=work, args=(i,)) for i in range(len(xs))]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    assert not errors, errors


def _codecs_in_child(queue) -> None:
    # numpy only around the codecs: torch's own OpenMP pool hangs in a forked child (not ours)
    rng = np.random.default_rng(6)
    x = torch.from_numpy(np.maximum(rng.standard_normal(9 * CHUNK, dtype=np.float32), 0))
    ok = bool(np.array_equal(pack_bitmap(x).unpack().numpy(), x.numpy()))
    p = pack_topk(x.view(9, -1), 0.9)
    ok &= p.nnz == 9 * kept_per_row(CHUNK, 0.9) and bool((p.unpack().numpy() != 0).sum() == p.nnz)
    ok &= bool(np.array_equal(pack_mask(x, 0.0).unpack().numpy(), (x.numpy() > 0).astype(np.float32)))
    queue.put(ok)


@needs_native
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_kernels_work_after_fork() -> None:
    with threads(4):
        x = torch.relu(torch.randn(9 * CHUNK))
        assert torch.equal(pack_bitmap(x).unpack(), x)  # the parent's worker threads now exist
        assert _cpu_kernels._native.pool_workers() >= 1
        ctx = multiprocessing.get_context("fork")
        queue = ctx.Queue()
        child = ctx.Process(target=_codecs_in_child, args=(queue,))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # Python 3.12: fork with threads
            child.start()
        try:
            child.join(timeout=60)
            assert child.exitcode == 0, "the forked child hung or crashed"
            assert queue.get(timeout=60)  # a hang guard: the child put its answer before it exited
        finally:
            if child.is_alive():
                child.kill()


# --- the fallback ---------------------------------------------------------------------------------


def test_fallback_gives_identical_bytes() -> None:
    x = sample(3 * CHUNK + 11, torch.float32, 0.5, seed=12, choices=[0.5, -1.0, 2.0, 3.0])
    idx = torch.randint(-300, 300, (1000,), dtype=torch.int64)
    results = []
    for native in ([True, False] if _cpu_kernels.NATIVE else [False]):
        with contextlib.nullcontext() if native else torch_ops():
            b, k = pack_bitmap(x, 0.6), pack_topk(x.view(1, -1), 0.9)
            m, n = pack_mask(x, 0.0, 2.5, inside=1.0), pack_narrow(idx)
            results.append((b, b.unpack(), k, k.unpack(), m.bitmap, m.unpack(), n.values, n.unpack()))
    for a, b in zip(results[0], results[-1]):
        if isinstance(a, BitmapTensor):
            assert same_packed(a, b)
        else:
            assert torch.equal(ints(a), ints(b))


def test_missing_extension_warns_once_with_the_fix(monkeypatch) -> None:
    monkeypatch.setattr(_cpu_kernels, "NATIVE", False)
    monkeypatch.setattr(_backend, "CPU", _backend.TORCH)  # what the table holds without the extension
    monkeypatch.setattr(_cpu_kernels, "_native", None)
    monkeypatch.setattr(_cpu_kernels, "_FORCED_OFF", False)
    monkeypatch.setattr(_cpu_kernels, "_warned", False)
    monkeypatch.setattr(_cpu_kernels, "UNAVAILABLE_REASON", "ImportError: no module named _native")
    x = torch.relu(torch.randn(100))
    with pytest.warns(RuntimeWarning, match=r"(?s)no module named _native.*slower.*C compiler.*reinstall") as rec:
        assert torch.equal(pack_bitmap(x).unpack(), x)
        pack_topk(x.view(4, 25), 0.5)
        pack_mask(x, 0.0)
    assert len([w for w in rec if issubclass(w.category, RuntimeWarning)]) == 1


def _run(code: str, env: dict[str, str] | None = None) -> dict:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_env_var_forces_the_fallback_silently() -> None:
    code = (
        "import json, warnings, torch\n"
        "warnings.simplefilter('error')\n"
        "from edgetorch import pack_bitmap\n"
        "from edgetorch.codecs import _cpu_kernels\n"
        "x = torch.relu(torch.randn(1000))\n"
        "ok = torch.equal(pack_bitmap(x).unpack(), x)\n"
        "print(json.dumps({'native': _cpu_kernels.NATIVE, 'ok': ok, 'how': _cpu_kernels.build_description()}))\n"
    )
    out = _run(code, {"EDGETORCH_NO_NATIVE": "1"})
    assert out == {"native": False, "ok": True, "how": "torch ops (EDGETORCH_NO_NATIVE is set)"}


def test_extension_is_built_where_a_compiler_exists() -> None:
    # the extension is optional, so a failed build passes silently at install time: catch it here
    if _cpu_kernels._FORCED_OFF:
        pytest.skip("EDGETORCH_NO_NATIVE is set")
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        pytest.skip(f"no C compiler ({compiler}) on this machine: the torch-ops fallback is expected")
    assert _cpu_kernels.NATIVE, f"{compiler} exists but the extension did not load: {_cpu_kernels.UNAVAILABLE_REASON}"


_FIRST_CALL_CPU = """
import json, resource, time, torch
x = torch.relu(torch.randn(1000))
import edgetorch
def cpu():  # this process's threads and any child it waited for (a compiler run at first use)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime
start = cpu()
y = edgetorch.pack_bitmap(x).unpack()
print(json.dumps({"cpu_seconds": cpu() - start, "ok": torch.equal(y, x)}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_import_and_first_pack_are_cheap() -> None:
    # numba added ~120 MiB and ~0.5-1 s here; the extension measures ~2 MiB and ~1 ms (bench)
    out = first_call_footprint()
    assert out["rss_delta_bytes"] <= 25 * 2**20, f"import edgetorch + first pack added {out['rss_delta_bytes'] / 2**20:.1f} MiB"
    assert out["first_call_seconds"] >= 0 and out["native"] == _cpu_kernels.NATIVE
    # The first call's cost in CPU time, which other processes on a busy machine do not inflate
    # (its wall time, first_call_seconds above, they can): a JIT compile or a build at first use
    # takes far more than this.
    first = _run(_FIRST_CALL_CPU)
    assert first["ok"] and first["cpu_seconds"] <= 0.5, f"the first pack + unpack took {first['cpu_seconds']:.2f} s of CPU"
