"""capture_step: a whole training step (forward under a policy, backward, optimizer step) as one CUDA graph.

The argument checks and the static-shape check run anywhere; the captures need a CUDA device
(skipped without one): N replays must train the model as N eager steps do, and a replay must
not sync with the host.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import edgetorch
from edgetorch.activations.graphed import CapturedStep, CaptureError, capture_step

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(  # no dropout: the eager reference must draw nothing at random
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU6(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    )


def _batches(n: int, device: str, batch: int = 8, size: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 3, size, size, generator=g).to(device),
             torch.randint(0, 10, (batch,), generator=g).to(device)) for _ in range(n)]


# -- anywhere ---------------------------------------------------------------------------------

def test_refuses_a_cpu_model() -> None:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    (x, y), = _batches(1, "cpu")
    with pytest.raises(ValueError, match="CUDA device"):
        capture_step(model, edgetorch.BackRazor(0.9), opt, x, y)


def test_refuses_what_a_graph_cannot_replay() -> None:
    model = _net()
    (x, y), = _batches(1, "cpu")
    adam = torch.optim.Adam(model.parameters(), capturable=False)
    with pytest.raises(ValueError, match=r"capturable=True"):
        capture_step(model, None, adam, x, y)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="seeds"):
        capture_step(model, edgetorch.Quantized(8, stochastic=True), sgd, x, y)
    with pytest.raises(ValueError, match="warmup"):
        capture_step(model, None, sgd, x, y, warmup=0)
    with pytest.raises(TypeError, match="Policy"):
        capture_step(model, "backrazor", sgd, x, y)
    with pytest.raises(TypeError, match="Optimizer"):
        capture_step(model, None, "sgd", x, y)


class _Graph:
    """Stands in for a torch.cuda.CUDAGraph: counts replays."""

    def __init__(self):
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


def test_a_batch_of_another_shape_is_refused_before_any_replay() -> None:
    graph = _Graph()
    step = CapturedStep(graph, torch.zeros(4, 3, 8, 8), torch.zeros(4, dtype=torch.long), torch.zeros(()))
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))
    for bad_x, bad_y in [(torch.randn(3, 3, 8, 8), y), (x, torch.randint(0, 10, (3,))),
                         (x.double(), y), (x, y.int())]:
        with pytest.raises(ValueError, match="fixed shapes"):
            step(bad_x, bad_y)
    with pytest.raises(TypeError):
        step(x.numpy(), y)
    assert graph.replays == 0
    assert step(x, y) is step.loss and graph.replays == 1
    assert torch.equal(step.x, x) and torch.equal(step.y, y)  # the batch was copied into the static inputs


def test_the_sync_check_names_the_part_of_the_step_that_syncs(monkeypatch) -> None:
    """The last warm-up step's check, on the CPU: torch's sync-debug switch is faked, and a part
    of the step raises what torch raises in "error" mode when it syncs."""
    from edgetorch.activations import graphed

    mode = {"now": 0}
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: mode["now"])
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda m: mode.update(now=m))

    def syncs(*_):
        if mode["now"] == "error":
            raise RuntimeError("called a synchronizing CUDA operation")

    policy = edgetorch.BackRazor(0.9)
    (x, y), = _batches(1, "cpu")
    cases = {"the forward under policy 'backrazor:sparsity=0.9'": "forward",
             "loss_fn 'cross_entropy'": "loss", "backward under": "backward", "SGD.step()": "step"}
    for expected, where in cases.items():
        model = _net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if where == "forward":
            model[3].register_forward_hook(syncs)
        elif where == "backward":
            model[3].register_forward_hook(lambda m, i, out: [out.register_hook(syncs), None][1])
        elif where == "step":
            opt.register_step_pre_hook(syncs)

        def loss_fn(out, target, where=where):
            if where == "loss":
                syncs()
            return F.cross_entropy(out, target)
        loss_fn.__name__ = "cross_entropy"
        with pytest.raises(CaptureError, match=expected.replace("(", r"\(").replace(")", r"\)")) as caught:
            graphed._step(model, policy, opt, x, y, loss_fn, check=f"policy {policy.spec()!r}")
        assert "Capturable" in str(caught.value) and mode["now"] == 0  # the mode was put back
        graphed._step(model, policy, opt, x, y, loss_fn)  # unchecked, the same step runs
    with pytest.raises(RuntimeError, match="other"):  # any other error is not a sync: passed on
        graphed._step(_net(), None, opt, x, y, lambda *_: (_ for _ in ()).throw(RuntimeError("other")), check="p")


class _FakeCuda:
    """torch.cuda's stream, graph and memory calls as no-ops on the CPU: capture_step's order of
    work runs (the "captured" step runs once, eagerly), so its Python is checked without a GPU."""

    def __init__(self, monkeypatch, fail_in_capture: bool = False):
        from edgetorch.activations import graphed

        self.events: list = []
        self.mode = 0
        fake = self

        class Graph:
            def __init__(self):
                self.replays = 0

            def replay(self):
                self.replays += 1

        @contextlib.contextmanager
        def graph(g):
            fake.events.append("capture begins")
            if fail_in_capture:
                raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
            yield
            fake.events.append("capture ends")

        class Stream:
            def __init__(self, *a, name="a side stream"):
                self.name = name

            def wait_stream(self, other):
                pass

            def __repr__(self):
                return self.name

        caller = Stream(name="the caller's stream")

        def set_mode(m):
            fake.mode = m
            fake.events.append(f"sync mode {m}")

        for name, value in {"Stream": Stream, "stream": lambda s: contextlib.nullcontext(),
                            "current_stream": lambda *a: caller, "synchronize": lambda *a: None,
                            "CUDAGraph": Graph, "graph": graph, "empty_cache": lambda: None,
                            "memory_reserved": lambda *a: 1000 * len(fake.events),
                            "memory_allocated": lambda *a: 10 * len(fake.events),
                            "max_memory_allocated": lambda *a: 20 * len(fake.events),
                            "reset_peak_memory_stats": lambda *a: setattr(fake, "peak_reset_at", len(fake.events)),
                            "set_stream": lambda s: fake.events.append(f"set_stream {s}"),
                            "get_sync_debug_mode": lambda: fake.mode, "set_sync_debug_mode": set_mode}.items():
            monkeypatch.setattr(torch.cuda, name, value)
        monkeypatch.setattr(graphed, "_check_arguments", lambda *a: torch.device("cpu"))


def test_capture_steps_in_order_with_cuda_faked(monkeypatch) -> None:
    fake = _FakeCuda(monkeypatch)
    model = _net()
    before = copy.deepcopy(model)
    forwards = []
    model.register_forward_pre_hook(lambda m, args: forwards.append(m.training))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    zeroed = []
    real_zero = opt.zero_grad
    opt.zero_grad = lambda set_to_none=True: (zeroed.append((set_to_none, len(fake.events))), real_zero(set_to_none))[1]
    (x, y), = _batches(1, "cpu")
    step = capture_step(model, edgetorch.Dense(), opt, x, y, warmup=3)
    assert len(forwards) == 4  # three warm-up steps, then the one that is captured
    # the last warm-up step alone is checked for syncs, part by part, and the mode is put back
    assert fake.events.count("sync mode error") == 4 and fake.mode == 0
    begins = fake.events.index("capture begins")
    assert zeroed[-1] == (True, begins) and len(zeroed) == 4  # grads set to None just before capture, not in it
    assert all(p.grad is not None for p in model.parameters())  # the captured backward made them
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), before.parameters()))
    assert step.pool_bytes > 0  # memory_reserved grew across the capture (faked: with the events)
    assert fake.peak_reset_at == begins  # the peak counts from just before the capture
    assert step.peak_bytes > 0
    assert step.x is not x and torch.equal(step.x, x) and step.loss.shape == ()
    assert step.graph.replays == 0
    step(x, y)
    assert step.graph.replays == 1
    assert "dense" in repr(step)


def test_a_failed_capture_raises_capture_error_and_restores_the_stream(monkeypatch) -> None:
    fake = _FakeCuda(monkeypatch, fail_in_capture=True)
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    (x, y), = _batches(1, "cpu")
    with pytest.raises(CaptureError, match="not permitted when stream is capturing") as caught:
        capture_step(model, edgetorch.BackRazor(0.9), opt, x, y, warmup=2)
    assert "backrazor:sparsity=0.9" in str(caught.value) and "Capturable" in str(caught.value)
    assert fake.events[-1] == "set_stream the caller's stream"


# -- CUDA ---------------------------------------------------------------------------------------

def _eager_step(model, policy, opt, x, y) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    scope = edgetorch.compress_activations(model, policy) if policy is not None else torch.enable_grad()
    with scope:
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


@pytest.fixture()
def deterministic():
    saved = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    yield
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved


POLICIES = {"plain": None, "dense": edgetorch.Dense(), "backrazor": edgetorch.BackRazor(0.9),
            "backrazor-int8": edgetorch.BackRazor(0.9, exact="int8"), "quantized8": edgetorch.Quantized(8)}


@cuda
@pytest.mark.parametrize("name", list(POLICIES))
def test_replays_train_as_eager_steps_do(name, deterministic) -> None:
    policy, warmup = POLICIES[name], 2
    model = _net().cuda().train()
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    (x0, y0), *batches = _batches(4, "cuda")
    step = capture_step(model, policy, opt, x0, y0, warmup=warmup)
    for _ in range(warmup):  # capture_step's warm-up steps are real steps on (x0, y0)
        _eager_step(reference, policy, ref_opt, x0, y0)
    for x, y in batches:
        loss = step(x, y).clone()
        ref_loss = _eager_step(reference, policy, ref_opt, x, y)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    torch.cuda.synchronize()
    for (k, a), b in zip(model.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{name} {k}: {m}")
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), _net().cuda().parameters()))  # it trained


@cuda
def test_adam_capturable_replays_as_eager(deterministic) -> None:
    model = _net().cuda().train()
    reference = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=True)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-3, capturable=True)
    (x0, y0), *batches = _batches(3, "cuda")
    policy = edgetorch.Dense()  # the engine, storing everything as it is
    step = capture_step(model, policy, opt, x0, y0, warmup=2)
    for _ in range(2):
        _eager_step(reference, policy, ref_opt, x0, y0)
    for x, y in batches:
        step(x, y)
        _eager_step(reference, policy, ref_opt, x, y)
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@cuda
@pytest.mark.parametrize("name", ["plain", "backrazor", "quantized8"])
def test_a_replay_makes_no_host_sync(name) -> None:
    model = _net().cuda().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    (x0, y0), (x, y) = _batches(2, "cuda")
    step = capture_step(model, POLICIES[name], opt, x0, y0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing call below raises
    try:
        for _ in range(3):
            loss = step(x, y)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss).item()
    assert step.pool_bytes is not None and step.pool_bytes > 0
    # the step's allocator peak: at least its gradients, at most what the pool reserved
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    assert grads <= step.peak_bytes <= step.pool_bytes


@cuda
def test_a_syncing_step_is_refused_before_capture_and_the_model_still_trains() -> None:
    model = _net().cuda().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    (x, y), = _batches(1, "cuda")

    def reads_back(out, target):
        loss = F.cross_entropy(out, target)
        return loss * (1.0 if loss.item() > -1 else 0.0)  # .item(): a host sync

    stream = torch.cuda.current_stream()
    with pytest.raises(CaptureError, match="reads_back"):
        capture_step(model, None, opt, x, y, reads_back)
    assert torch.cuda.current_stream() == stream and torch.cuda.get_sync_debug_mode() == 0
    assert torch.isfinite(_eager_step(model, edgetorch.Dense(), opt, x, y)).item()


@pytest.mark.parametrize("policy", [edgetorch.Bitmap(), edgetorch.Bitmap(threshold=0.01)])
def test_bitmap_is_refused_by_name_before_any_step(policy) -> None:
    """A bitmap's values are sized from earlier steps' counts and checked on the host: a replayed
    graph would skip the check, and a tensor that kept more than its slots would lose values
    silently. So it is refused by name, before any step runs (here on the CPU: nothing is needed
    of a GPU to refuse it)."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    (x, y), = _batches(1, "cpu")
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(CaptureError, match="bitmap.*sizes each bitmap.*Capturable"):
        capture_step(model, policy, opt, x, y)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # no step ran


@cuda
def test_the_captured_shape_is_enforced_on_cuda() -> None:
    model = _net().cuda().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    (x, y), = _batches(1, "cuda")
    step = capture_step(model, None, opt, x, y, warmup=2)
    with pytest.raises(ValueError, match="fixed shapes"):
        step(x[:4], y[:4])
