"""tilewire.bench_block without a GPU: the plain-PyTorch tensor-parallel block (torch-tp) is the
plain block at worlds 1, 2 and 4 (the interleaved q/k/v and gate/up shards, the emulated
all-gather and reduce-scatter, the gradients); one world's rows at world 1 with CPU stand-ins of
the tilewire ops and a stand-in timer (every variant timed, the losses agree, the table's
speedups), with --cp the context-parallel row too (a stand-in of the ring at world 1); the
argument checks; the plot from a JSON file. Skipped without torch."""

import argparse
import types

import pytest

torch = pytest.importorskip("torch")

from _host import FakeComm, forbid_library  # noqa: E402
from tilewire import _nn_attention, bench_block, example_block  # noqa: E402
from tilewire import nn as twnn  # noqa: E402

bf16 = torch.bfloat16


def _product(comm, a, b, buf, grad_workspace=None):
    return (a.float() @ b.float().t()).to(bf16)  # world 1: every op is the product


@pytest.fixture
def stand_ins(monkeypatch):
    forbid_library(monkeypatch)
    for name in ("ag_gemm", "gemm_rs", "gemm_ar"):
        monkeypatch.setattr(twnn, name, _product)
    monkeypatch.setattr(twnn, "gemm_rs_workspace", lambda comm, m, n: None)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_torch_tp_is_the_plain_block(world):
    ref = example_block.bf16_values(example_block.TorchBlock(32, 4, 48, seed=world))
    g = torch.Generator().manual_seed(world)
    x = torch.randn(16, 32, generator=g).to(bf16)
    want = ref(x.float())
    tp = bench_block.TorchTPBlock(torch, ref, world, "cpu")
    got = torch.cat(tp.forward(list(x.chunk(world))))
    assert (got.float() - want).abs().max() < 5e-2 * want.abs().max()
    loss = bench_block.mse_sum(torch, tp.forward(list(x.chunk(world))),
                               list(torch.zeros(16, 32).chunk(world)), 16 * 32)
    loss.backward()
    ((ref(x.float()) ** 2).sum() / (16 * 32)).backward()
    grad = torch.cat([w.grad.float() for w in tp.wdown], dim=1)
    assert (grad - ref.down.weight.grad).abs().max() < 5e-2 * ref.down.weight.grad.abs().max()


class _Comm(FakeComm):
    def close(self):
        pass


def _args(**kw):
    base = dict(world=[1], tokens=16, hidden=32, heads=4, ffn=48, moe=False, cp=False,
                warmup=1, repeats=2, json=None)
    base.update(kw)
    return argparse.Namespace(**base)


def test_run_world_at_world_1(stand_ins):
    calls = []

    def timer(torch_, fn, warmup, repeats):
        calls.append(fn)
        for _ in range(warmup + repeats):
            fn()
        return 0.001 * len(calls)

    tw = types.SimpleNamespace(init_virtual=lambda world: [_Comm()],
                               for_each_rank=lambda comms, fn: [fn(c) for c in comms])
    args = _args()
    rows, ok = bench_block.run_world(torch, tw, args, 1, device="cpu", timer=timer)
    assert ok and [r[0] for r in rows] == ["tilewire", "torch-tp", "torch"]
    assert all(r[3] <= 5e-2 for r in rows), rows
    lines = bench_block.format_rows(1, args, rows)
    assert "tilewire 2.00x" in lines[1] and "tilewire 3.00x" in lines[2], lines


def _cpu_ring(comm, q, k, v, k_buf, v_buf, causal, layout, softmax_scale, grad):
    """_nn_attention._ring_staged's stand-in at world 1 (the zigzag shard is the sequence):
    causal attention in fp32."""
    assert comm.size == 1 and causal and layout == "zigzag"
    o = torch.nn.functional.scaled_dot_product_attention(
        *(t.float().transpose(1, 2) for t in (q, k, v)), is_causal=True)
    return o.transpose(1, 2).to(bf16)


def test_run_world_with_cp_at_world_1(stand_ins, monkeypatch):
    monkeypatch.setattr(_nn_attention, "_ring_staged", _cpu_ring)
    times = {"tilewire": 0.002, "tilewire-cp": 0.001, "torch-tp": 0.004, "torch": 0.003}
    called = []

    def timer(torch_, fn, warmup, repeats):
        fn()
        called.append(fn)
        return list(times.values())[len(called) - 1]

    tw = types.SimpleNamespace(init_virtual=lambda world: [_Comm()],
                               for_each_rank=lambda comms, fn: [fn(c) for c in comms])
    args = _args(cp=True, hidden=128, heads=2)  # head_dim 64, the ring's
    rows, ok = bench_block.run_world(torch, tw, args, 1, device="cpu", timer=timer)
    assert ok and [r[0] for r in rows] == list(times), rows
    assert all(r[3] <= 5e-2 for r in rows), rows
    lines = bench_block.format_rows(1, args, rows)
    assert lines[1].startswith("world 1  tilewire-cp ") and lines[1].rstrip().endswith(")")
    assert lines[2].rstrip().endswith("tilewire 2.00x"), lines  # torch-tp: no CP analogue
    assert lines[3].rstrip().endswith("tilewire 1.50x, tilewire-cp 3.00x"), lines


def test_flops_and_arguments():
    a = _args(tokens=8, hidden=16, ffn=32)
    assert bench_block.step_flops(a) == 3 * (2 * 8 * 16 * (4 * 16 + 3 * 32) + 2 * 8 * 8 * 16)
    assert bench_block.parse(["--world", "2", "4"]).world == [2, 4]
    for bad in (["--world", "3"], ["--world", "9"], ["--hidden", "100"]):
        with pytest.raises(SystemExit):
            bench_block.parse(bad)
    assert bench_block.parse(["--cp"]).cp  # the defaults: head_dim 128, 4096 tokens
    for bad in (["--cp", "--heads", "8"], ["--cp", "--world", "8", "--tokens", "4104"]):
        bench_block.parse(bad[1:])  # fine without --cp
        with pytest.raises(SystemExit):  # head_dim 256; 4104 tokens: no 16 equal chunks
            bench_block.parse(bad)


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    doc = {"date": "2026-12-03", "gpu": "H200", "args": {"tokens": 16, "hidden": 32, "ffn": 48},
           "rows": [{"world": w, "variant": v, "seconds": s} for w in (2, 4)
                    for v, s in (("tilewire", 0.01), ("torch-tp", 0.02), ("torch", 0.015))]}
    src, png = tmp_path / "block.json", tmp_path / "block.png"
    src.write_text(__import__("json").dumps(doc))
    assert bench_block.main(["--plot", str(src), str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
