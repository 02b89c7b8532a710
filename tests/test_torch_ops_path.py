"""How ``omniep.torch`` enters a backend written in Python (the collective backend; DESIGN §5): eagerly
through ``torch_ops.EAGER`` — no dispatcher boxing, our own autograd — and through the ``omniep::*`` ops
whenever something traces (torch.compile, a dispatch mode). Both give the same bits, gradients
included, and a profiler sees the ops by name either way."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
ep = pytest.importorskip("omniep.torch")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

E = 4


def _inputs():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(6, 8, generator=gen)
    idx = torch.randint(-1, E, (6, 2), generator=gen)
    return x, idx, torch.rand(6, 2, generator=gen)


def _pair(x, idx, w, layout, zero_padding=False):
    """dispatch -> (recv_x * 3) -> combine, the loss's gradients: (out, recv_x, g_x, g_w)."""
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    d = ep.dispatch(x, idx, w, num_experts=E, layout=layout, capacity=None if layout == "rank_major" else 12,
                    backend="collective", zero_padding=zero_padding)
    out = ep.combine(d.recv_x * 3.0, d.handle)
    (out * torch.arange(8.0)).sum().backward()
    return out.detach(), d.recv_x.detach(), x.grad, w.grad


class _SeenOps(TorchDispatchMode):
    """Records the names of the ops that reach the dispatcher's Python modes."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("layout, zero_padding", [("rank_major", False), ("expert_major", False),
                                                  ("expert_major", True)])
def test_eager_and_dispatcher_paths_agree_bitwise(world_of_one, monkeypatch, layout, zero_padding):
    from omniep.backends.collective.torch_backend import CollectiveTorch

    seen, op_dispatch = [], CollectiveTorch.op_dispatch

    def recording(self, *args):  # the zero_padding the backend gets (its last argument)
        seen.append(args[-1])
        return op_dispatch(self, *args)

    monkeypatch.setattr(CollectiveTorch, "op_dispatch", recording)
    eager = _pair(*_inputs(), layout, zero_padding)
    mode = _SeenOps()
    with mode:  # a dispatch mode is active: the frontend goes through torch.ops.omniep
        traced = _pair(*_inputs(), layout, zero_padding)
    assert seen == [zero_padding, zero_padding]
    assert "omniep.dispatch.default" in mode.names and "omniep.combine.default" in mode.names, mode.names
    for a, b, what in zip(eager, traced, ("out", "recv_x", "g_x", "g_w")):
        assert torch.equal(a.view(torch.int32) if a.dtype == torch.float32 else a,
                           b.view(torch.int32) if b.dtype == torch.float32 else b), what


def test_eager_path_skips_the_dispatcher(world_of_one):
    """Eagerly, with grad, the pair never calls the context's ``torch.ops`` namespace (a recorder stands in
    for it); under a dispatch mode the same pair does."""
    from omniep.frontends import torch_ops

    ctx = ep.context(backend="collective", device="cpu")
    assert ctx.eager_ops is torch_ops.EAGER
    calls, real = [], ctx.ops

    class Recorder:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(real, name)

    ctx.ops = Recorder()
    try:
        _pair(*_inputs(), "rank_major")
        assert calls == []
        with _SeenOps():
            _pair(*_inputs(), "rank_major")
        assert calls == ["dispatch", "combine"]
    finally:
        ctx.ops = real


@pytest.mark.parametrize("layout", ["rank_major", "expert_major"])
def test_eager_ops_record_a_graph_exactly_when_a_gradient_is_needed(world_of_one, layout):
    """The eager entry goes through its autograd Function only where a tensor argument needs a gradient (and
    grad mode is on); either way the results are the same bits."""
    cap = None if layout == "rank_major" else 12

    def pair(x, w, grad_mode=True):
        with torch.set_grad_enabled(grad_mode):
            d = ep.dispatch(x, idx, w, num_experts=E, layout=layout, capacity=cap, backend="collective")
            return d.recv_x, ep.combine(d.recv_x * 3.0, d.handle)

    x, idx, w = _inputs()
    plain = pair(x, w)
    assert not any(t.requires_grad for t in plain)
    for needs in ("x", "w"):  # one differentiable input is enough
        xg = x.clone().requires_grad_(needs == "x")
        wg = w.clone().requires_grad_(needs == "w")
        tracked = pair(xg, wg)
        assert tracked[1].grad_fn is not None, needs
        assert all(torch.equal(a, b.detach()) for a, b in zip(plain, tracked)), needs
        off = pair(xg, wg, grad_mode=False)
        assert not any(t.requires_grad for t in off), needs
        assert all(torch.equal(a, b) for a, b in zip(plain, off)), needs


def test_a_profiler_sees_the_eager_ops_by_name(world_of_one):
    from torch.profiler import ProfilerActivity, profile

    x, idx, w = _inputs()
    x.requires_grad_()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        d = ep.dispatch(x, idx, w, num_experts=E, backend="collective")
        ep.combine(d.recv_x * 2.0, d.handle).sum().backward()
    names = {e.name for e in prof.events()}
    for op in ("dispatch", "combine", "dispatch_bwd"):
        assert f"omniep::{op}" in names, (op, sorted(n for n in names if "omniep" in n))


@pytest.mark.parametrize("layout, zero_padding", [("rank_major", True), ("expert_major", False),
                                                  ("expert_major", True)])
def test_dispatch_zero_padding_reaches_combine_bwd(world_of_one, monkeypatch, layout, zero_padding):
    """The dispatch's ``zero_padding`` rides on its handle to the combine's backward: ``combine_bwd`` gets
    it as its last argument eagerly, through the dispatcher (a dispatch mode) and in the backward graph of
    ``torch.compile(fullgraph=True)`` (the fake kernels take it); rank-major ignores it (False). The three
    give the same g_y, its padding zero here (the collective backend's zeros)."""
    from omniep.backends.collective.torch_backend import CollectiveTorch

    seen, op_combine_bwd = [], CollectiveTorch.op_combine_bwd

    def recording(self, *args):  # the zero_padding the backend gets (its last argument)
        seen.append(args[-1])
        return op_combine_bwd(self, *args)

    monkeypatch.setattr(CollectiveTorch, "op_combine_bwd", recording)
    x, idx, w = _inputs()
    em = layout == "expert_major"
    rows = 12 if em else 8
    y0 = torch.randn((E, rows, 8) if em else (rows, 8), generator=torch.Generator().manual_seed(3))
    g_out = torch.randn(6, 8, generator=torch.Generator().manual_seed(4))

    def step(x, idx, w, y):
        d = ep.dispatch(x, idx, w, num_experts=E, layout=layout, capacity=rows, backend="collective",
                        zero_padding=zero_padding)
        return ep.combine(y, d.handle), d.recv_topk_idx

    def run(fn):
        y = y0.clone().requires_grad_()
        out, recv_idx = fn(x, idx, w, y)
        (g_y,) = torch.autograd.grad(out, y, g_out)
        return g_y, recv_idx

    eager, held = run(step)
    with _SeenOps() as mode:
        traced, _ = run(step)
    assert "omniep.combine_bwd.default" in mode.names, mode.names
    compiled, _ = run(torch.compile(step, fullgraph=True))
    assert seen == [zero_padding and em] * 3
    for got, what in ((traced, "dispatcher"), (compiled, "compiled")):
        assert torch.equal(got.view(torch.int32), eager.view(torch.int32)), what
    if em:
        pad = eager[held < 0]
        assert pad.numel() and not pad.any()


def test_native_eager_ops_take_the_direct_entries_where_the_module_has_them():
    """A native backend's eager ops (``torch_ops.Overloads``): its module's ``eager_<op>`` for the ops the
    module enters directly, the op's ``.default`` overload for the rest — every op of the schemas either way."""
    import types

    from omniep.frontends import torch_ops

    class Op:
        def __init__(self, name):
            self.default = f"{name}.default"

    namespace = types.SimpleNamespace(**{name: Op(name) for name in torch_ops.SCHEMAS})
    direct = types.SimpleNamespace(eager_dispatch="direct dispatch", eager_combine="direct combine")
    ops = torch_ops.Overloads(namespace, direct)
    for name in torch_ops.SCHEMAS:
        want = getattr(direct, f"eager_{name}", f"{name}.default")
        assert getattr(ops, name) == want, name
    plain = torch_ops.Overloads(namespace)
    assert all(getattr(plain, name) == f"{name}.default" for name in torch_ops.SCHEMAS)


def test_the_default_device_mode_is_off_inside_the_ops_and_back_after(world_of_one):
    """``torch.set_default_device`` (DeepEP's tests set it) puts a torch function mode on the stack whose Python
    ``__torch_function__`` every tensor access then goes through (2x a Buffer LL op's host time on GPU). The
    ops' entries take it off for the op and put it back: same bits, no call of it inside, and any other mode
    still sees the op's calls."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._device import DeviceContext

    from omniep.ep_core.errors import InputError

    class CountingDevice(DeviceContext):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            CountingDevice.calls += 1
            return super().__torch_function__(func, types, args, kwargs)

    class Counting(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Counting.calls += 1
            return func(*args, **(kwargs or {}))

    _, idx, w = _inputs()
    T, H = 6, 128
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    buf = ep.Buffer(None, 0, ep.Buffer.get_low_latency_rdma_size_hint(T, H, 1, E), low_latency_mode=True,
                    num_qps_per_rank=E)

    inside = [0]

    def op(fn, *args, **kwargs):  # the mode's calls while an op runs, counted apart from this test's own
        before = CountingDevice.calls
        try:
            return fn(*args, **kwargs)
        finally:
            inside[0] += CountingDevice.calls - before

    y = torch.randn(E, T, H, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)

    def ops():
        d = op(ep.dispatch, x, idx, w, num_experts=E, capacity=T, layout="expert_major", backend="collective")
        out = op(ep.combine, y.float(), d.handle)
        rank_major = op(ep.dispatch, x, idx, w, num_experts=E, backend="collective")
        again = op(ep.cached_dispatch, x, rank_major.handle)
        (x8, scales), count, handle, _, _ = op(buf.low_latency_dispatch, x, idx, T, E, use_fp8=True)
        ll_out, _, _ = op(buf.low_latency_combine, y, idx, w, handle)
        return d.recv_x, again, out, x8.view(torch.uint8), scales, count, ll_out

    plain = ops()
    with CountingDevice("cpu"):
        under = ops()
        assert CountingDevice.calls > 0 and inside[0] == 0  # the test's calls went through it, the ops' none
        assert torch._C._len_torch_function_stack() == 1  # and it is back after them
        before = CountingDevice.calls
        torch.empty(1)
        assert CountingDevice.calls == before + 1
        with pytest.raises(InputError, match="num_experts"):
            ep.dispatch(x, idx, w, num_experts=0, backend="collective")
        assert torch._C._len_torch_function_stack() == 1  # back after an op that raised, too
        with Counting():  # another mode above it: left in place, it sees the op's calls as before
            ep.combine(y.float(), ep.dispatch(x, idx, w, num_experts=E, capacity=T, layout="expert_major",
                                              backend="collective").handle)
        assert Counting.calls > 0
    for a, b in zip(plain, under):
        assert torch.equal(a, b)
    buf.destroy()


def test_handle_replace_copies_with_the_changes_only(world_of_one):
    """``Handle.replace`` (the Buffer's LL combine swaps the weights in): a new handle of the same class, the
    original untouched, an unknown field refused as ``dataclasses.replace`` refuses it."""
    from omniep.frontends.torch_buffer import LowLatencyHandle

    T, H = 6, 128
    _, idx, w = _inputs()
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    buf = ep.Buffer(None, 0, ep.Buffer.get_low_latency_rdma_size_hint(T, H, 1, E), low_latency_mode=True,
                    num_qps_per_rank=E)
    handle = buf.low_latency_dispatch(x, idx, T, E, use_fp8=True)[2]
    weights = w * 2.0
    new = handle.replace(topk_weights=weights)
    assert type(new) is LowLatencyHandle and new is not handle
    assert new.topk_weights is weights and handle.topk_weights is not weights
    assert {k: v for k, v in vars(new).items() if k != "topk_weights"} == \
        {k: v for k, v in vars(handle).items() if k != "topk_weights"}
    with pytest.raises(TypeError, match="no field 'weights'"):
        handle.replace(weights=weights)
    buf.destroy()
