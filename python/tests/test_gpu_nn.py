"""tilewire.nn on virtual ranks sharing one Hopper GPU: the tensor-parallel MLP (x sharded by
rows -> ColumnParallelLinear -> gelu -> RowParallelLinear, reduce "scatter" and "all"), every
rank's layers made from one torch.nn.Linear, against the plain torch MLP in fp32: forward,
and the gradients of the weights, biases and inputs. Skipped without torch or without a
Hopper GPU."""

import gc

import pytest

torch = pytest.importorskip("torch")

import tilewire  # noqa: E402
from _gpu import bf16, captured_graph, close_all, rel_err  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("hopper_synced")]

F = torch.nn.functional
HIDDEN, FFN = 256, 512
FWD_TOL, GRAD_TOL = 2e-2, 3e-2


def _reference_mlp(seed=0):
    """Two fp32 CUDA torch.nn.Linear, their values rounded to bf16 (what the layers hold)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        l1, l2 = torch.nn.Linear(HIDDEN, FFN), torch.nn.Linear(FFN, HIDDEN)
    l1, l2 = l1.cuda(), l2.cuda()
    with torch.no_grad():
        for p in (*l1.parameters(), *l2.parameters()):
            p.copy_(p.to(bf16).float())
    return l1, l2


def _tp_layers(comms, l1, l2, reduce):
    cols = [tilewire.nn.ColumnParallelLinear.from_linear(l1, c) for c in comms]
    rows = [tilewire.nn.RowParallelLinear.from_linear(l2, c, reduce=reduce) for c in comms]
    return cols, rows


def _tp_mlp(comms, cols, rows, xs):
    return tilewire.for_each_rank(
        comms, lambda c: rows[c.rank](F.gelu(cols[c.rank](xs[c.rank]))))


def _release(comms, *layer_lists):
    torch.cuda.synchronize()
    for layers in layer_lists:
        for m in layers:
            m.release_buffers()
        layers.clear()
    gc.collect()
    for c in comms:
        assert c.async_error() is None


def _shards(x, world):
    m = x.shape[0] // world
    return [x[r * m:(r + 1) * m].detach().to(bf16).clone() for r in range(world)]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("reduce", ["scatter", "all"])
def test_mlp_forward_and_backward(world, reduce):
    m_local = 64
    m = world * m_local
    l1, l2 = _reference_mlp()
    x = torch.randn(m, HIDDEN, device="cuda").to(bf16).float().requires_grad_()
    g = torch.randn(m, HIDDEN, device="cuda").to(bf16).float()
    y = l2(F.gelu(l1(x)))
    y.backward(g)
    comms = tilewire.init_virtual(world)
    try:
        cols, rows = _tp_layers(comms, l1, l2, reduce)
        for c, r in zip(cols, rows):  # before the ranks' loop: buffers and the backward's matmuls
            c.reserve(m_local, grad=True)
            r.reserve(m, grad=True)
        xs = [t.requires_grad_() for t in _shards(x, world)]
        ys = _tp_mlp(comms, cols, rows, xs)
        if reduce == "scatter":  # each rank's rows, and their part of the loss's gradient
            gs = _shards(g, world)
            tilewire.for_each_rank(comms, lambda c: ys[c.rank].backward(gs[c.rank]))
        else:  # every rank all of it, the loss replicated
            gb = g.to(bf16)
            tilewire.for_each_rank(comms, lambda c: ys[c.rank].backward(gb))
        torch.cuda.synchronize()
        if reduce == "scatter":
            assert rel_err(torch.cat(ys), y.detach()) < FWD_TOL
        for r in range(world):
            if reduce == "all":
                assert rel_err(ys[r], y.detach()) < FWD_TOL, "rank %d" % r
        grads = {
            "x": torch.cat([t.grad for t in xs]),
            "fc1.weight": torch.cat([c.weight.grad for c in cols]),
            "fc1.bias": torch.cat([c.bias.grad for c in cols]),
            "fc2.weight": torch.cat([r.weight.grad for r in rows], dim=1),
        }
        want = {"x": x.grad, "fc1.weight": l1.weight.grad, "fc1.bias": l1.bias.grad,
                "fc2.weight": l2.weight.grad}
        for name, got in grads.items():
            assert rel_err(got, want[name]) < GRAD_TOL, name
        if reduce == "scatter":  # each rank's bias gradient covers its rows: sum them
            bias_grad = sum(r.bias.grad.float() for r in rows)
            assert rel_err(bias_grad, l2.bias.grad) < GRAD_TOL
        else:
            for r in rows:
                assert rel_err(r.bias.grad, l2.bias.grad) < GRAD_TOL
        ys = None
        _release(comms, cols, rows)
    finally:
        close_all(comms)


def test_layers_round_trip_and_buffers_grow():
    """Inputs of 32, 64 then 16 rows per rank (no grad): the buffers grow once per size and
    the outputs stay the torch MLP's; to_linear rebuilds the torch layers exactly."""
    world = 2
    l1, l2 = _reference_mlp(seed=1)
    comms = tilewire.init_virtual(world)
    try:
        cols, rows = _tp_layers(comms, l1, l2, "scatter")
        for key, value in tilewire.nn.ColumnParallelLinear.to_linear(cols).state_dict().items():
            assert torch.equal(value.float(), l1.state_dict()[key]), key
        for key, value in tilewire.nn.RowParallelLinear.to_linear(rows).state_dict().items():
            assert torch.equal(value.float(), l2.state_dict()[key]), key
        with torch.no_grad():
            for m_local in (32, 64, 16):
                x = torch.randn(world * m_local, HIDDEN, device="cuda").to(bf16).float()
                ys = _tp_mlp(comms, cols, rows, _shards(x, world))
                torch.cuda.synchronize()
                assert rel_err(torch.cat(ys), l2(F.gelu(l1(x)))) < FWD_TOL, m_local
        assert cols[0]._tw_gathered.shape == (world * 64, HIDDEN)
        assert len(cols[0]._tw_retired) == 1
        ys = None
        _release(comms, cols, rows)
    finally:
        close_all(comms)


def test_mlp_cuda_graph_replays():
    """With the buffers reserved, the layers' forward is captured and replays on new inputs."""
    world, m_local = 2, 64
    l1, l2 = _reference_mlp(seed=2)
    comms = tilewire.init_virtual(world)
    try:
        cols, rows = _tp_layers(comms, l1, l2, "all")
        for c, r in zip(cols, rows):
            c.reserve(m_local)
            r.reserve(world * m_local)
        xs = [torch.zeros(m_local, HIDDEN, device="cuda", dtype=bf16) for _ in comms]
        outs = {}

        def step():
            outs["y"] = _tp_mlp(comms, cols, rows, xs)

        with torch.no_grad():
            graph = captured_graph(step)
            for _ in range(2):
                x = torch.randn(world * m_local, HIDDEN, device="cuda").to(bf16).float()
                for dst, src in zip(xs, _shards(x, world)):
                    dst.copy_(src)
                graph.replay()
                torch.cuda.synchronize()
                want = l2(F.gelu(l1(x)))
                for r in range(world):
                    assert rel_err(outs["y"][r], want) < FWD_TOL, "rank %d" % r
        graph = None
        outs.clear()
        _release(comms, cols, rows)
    finally:
        close_all(comms)


def test_mlp_torch_compile_world_1():
    """One rank: the column and row layers under torch.compile(fullgraph=True), buffers
    reserved (world 1: the row layer needs none)."""
    l1, l2 = _reference_mlp(seed=3)
    comms = tilewire.init_virtual(1)
    try:
        cols, rows = _tp_layers(comms, l1, l2, "scatter")
        cols[0].reserve(128)
        mlp = torch.compile(lambda x: rows[0](F.gelu(cols[0](x))), fullgraph=True)
        x = torch.randn(128, HIDDEN, device="cuda").to(bf16)
        with torch.no_grad():
            y = tilewire.for_each_rank(comms, lambda c: mlp(x))[0]
            torch.cuda.synchronize()
            assert rel_err(y, l2(F.gelu(l1(x.float())))) < FWD_TOL
        y = None
        _release(comms, cols, rows)
    finally:
        close_all(comms)
