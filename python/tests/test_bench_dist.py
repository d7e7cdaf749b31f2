"""python -m tilewire.bench_dist on the host: its shapes, the rows it assembles (speedups,
overlap, bounds; tilewire.bench's yardstick reads them), the launcher's environment and
arguments, and its usage errors. The ranks themselves need torch and one GPU each (the GPU
suite's multi step runs them)."""

import json

import pytest

from tilewire import _dist_sweep, bench, bench_dist


def test_shapes_are_the_sweeps():
    ag = bench_dist.shapes("ag_gemm")
    assert ag[0] == ("flux-tp8", 4096, 6144, 12288)
    assert [s[1:] for s in ag[1:]] == [(4096, 512, 4096), (8192, 1024, 8192),
                                       (16384, 2048, 16384)]
    rs = bench_dist.shapes("gemm_rs")
    assert rs[0] == ("flux-tp8", 4096, 12288, 6144)
    assert [s[1:] for s in rs[1:]] == [(4096, 4096, 512), (8192, 8192, 1024),
                                       (16384, 16384, 2048), (64, 8192, 1024)]
    assert rs[-1][0] == "decode" and ("decode", 64, 8192, 1024) in bench_dist.shapes("gemm_ar")
    assert bench_dist.shapes("gemm_ar")[-1] == ("small-m", 1024, 8192, 2048)
    assert all(len(bench_dist.shapes(op, quick=True)) >= 2 for op in bench_dist.OPS)
    assert bench_dist.shapes("gemm_rs", one=(64, 128, 256)) == [("", 64, 128, 256)]


def test_check_shape_names_what_is_wrong():
    assert bench_dist.check_shape("gemm_rs", ("", 4096, 4096, 512), 8) is None
    assert "multiple of world=3" in bench_dist.check_shape("gemm_rs", ("", 4096, 64, 64), 3)
    assert "multiples of 8" in bench_dist.check_shape("ag_gemm", ("", 64, 60, 64), 2)
    assert "positive" in bench_dist.check_shape("gemm_ar", ("", 0, 64, 64), 2)


def _rs_times():
    return {"nccl+torch": (1.5, 1.4, 1.6), "nccl-bf16+torch": (1.2, 1.1, 1.3),
            "gemm-alone": (1.0, 1.0, 1.0), "nccl-reduce": (0.6, 0.6, 0.6),
            "nccl-bf16-reduce": (0.3, 0.3, 0.3), "tilewire": (1.2, 1.1, 1.3),
            "tilewire-bf16p": (1.1, 1.0, 1.2)}


def test_rows_speedups_overlaps_and_bounds():
    rows = bench_dist.make_rows("gemm_rs", "M=8 N=8 K/rank=8 world=2 procs", 2e12,
                                _rs_times(), {"tilewire": True, "tilewire-bf16p": False})
    by = {r["variant"]: r for r in rows}
    assert by["tilewire"]["speedup"] == pytest.approx(1.5 / 1.2)
    assert by["tilewire"]["overlap"] == pytest.approx(1.0 / 1.2)
    # the fused bf16 row against the bf16 pipeline; the pipeline rows against fp32's
    assert by["tilewire-bf16p"]["speedup"] == pytest.approx(1.2 / 1.1)
    assert by["tilewire-bf16p"]["overlap"] == pytest.approx(1.0 / 1.1)
    assert by["nccl-bf16+torch"]["speedup"] == pytest.approx(1.5 / 1.2)
    assert by["tilewire-bf16p"]["ok"] is False and by["tilewire"]["ok"] is True
    assert by["bound"]["speedup"] == pytest.approx(1.6) and by["bound"]["ms"] == 1.0
    assert by["bound-bf16"]["speedup"] == pytest.approx(1.3)
    assert by["nccl-reduce"]["tflops"] == 0 and by["tilewire"]["tflops"] == pytest.approx(
        2e12 / 1.2e-3 / 1e12)
    # tilewire.bench's yardstick reads these rows (torch pipelines as NCCL's)
    yard = {r["variant"]: r for r in bench.bound_rows({"rows": rows})}
    assert yard["tilewire"]["of_bound"] == pytest.approx(1.25 / 1.6)
    assert yard["tilewire-bf16p"]["of_bound"] == pytest.approx((1.2 / 1.1) / 1.3)


def test_ag_gemm_rows():
    t = {"nccl+torch": (1.2, 1.2, 1.2), "gemm-alone": (1.0, 1.0, 1.0),
         "nccl-allgather": (0.3, 0.3, 0.3), "fused": (1.05, 1.0, 1.1),
         "fused-inplace": (1.0, 1.0, 1.0)}
    rows = bench_dist.make_rows("ag_gemm", "M=8 N=8/rank K=8 w=2 procs", 1e12, t, {})
    by = {r["variant"]: r for r in rows}
    assert by["fused"]["overlap"] == pytest.approx(1.0 / 1.05)
    assert by["fused-inplace"]["overlap"] == pytest.approx(1.0)
    assert by["fused-inplace"]["speedup"] == pytest.approx(1.2)
    assert by["bound"]["speedup"] == pytest.approx(1.3)
    assert "bound-bf16" not in by


def test_launcher_environment_and_arguments(monkeypatch):
    env = bench_dist.launch_env({"PATH": "/bin"}, 1, 2, 12345)
    assert env["RANK"] == "1" and env["WORLD_SIZE"] == "2" and env["LOCAL_RANK"] == "1"
    assert env["MASTER_PORT"] == "12345" and env["NCCL_NVLS_ENABLE"] == "0"
    assert bench_dist.launch_env({"NCCL_NVLS_ENABLE": "0"}, 0, 1, 1)["NCCL_NVLS_ENABLE"] == "0"
    started = []

    class FakeProc:
        def __init__(self, cmd, env, **kw):
            started.append((cmd, env))
            self.returncode = 3 if env["RANK"] == "1" else 0

        def communicate(self, timeout=None):
            return ("rank output\n", None)

    monkeypatch.setattr(bench_dist.subprocess, "Popen", FakeProc)
    rc = bench_dist.main(["--nproc", "2", "--quick", "--op", "gemm_rs"])
    assert rc == 3  # the worst rank's status
    assert len(started) == 2
    for rank, (cmd, env) in enumerate(started):
        assert cmd[1:3] == ["-m", "tilewire.bench_dist"]
        assert cmd[3:] == ["--quick", "--op", "gemm_rs"]  # every argument but --nproc
        assert env["RANK"] == str(rank) and env["WORLD_SIZE"] == "2"


def test_usage_errors(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    assert bench_dist.main(["--quick"]) == bench_dist.EXIT_USAGE
    assert "torchrun" in capsys.readouterr().err
    assert bench_dist.main(["--nproc", "0"]) == bench_dist.EXIT_USAGE
    assert bench_dist._parser().parse_args(["--host"]).host  # the host-cost mode
    with pytest.raises(SystemExit):
        bench_dist.main(["--op", "nope"])


def test_rows_round_trip_through_the_table(tmp_path):
    rows = bench_dist.make_rows("gemm_ar", "M=8 N=8 K/rank=8 world=2 procs", 1e12,
                                _rs_times(), {})
    doc = {"meta": {"tool": "tilewire.bench_dist", "gpu": "H200", "gpu_count": 2},
           "rows": rows}
    path = tmp_path / "d.json"
    path.write_text(json.dumps(doc))
    text = bench.format_table(json.loads(path.read_text()))
    assert "tilewire-bf16p" in text and "bound-bf16" in text
    assert "of-bound" in bench.format_bound_table(doc)


def test_profile_summary_busy_idle_and_kernels():
    # two calls: a fused kernel each (100 us), 20 us apart; a memset overlapping the first
    iv = [(0.0, 100.0, "gemm_rs_kernel"), (50.0, 60.0, "memset"),
          (120.0, 220.0, "gemm_rs_kernel")]
    p = bench_dist.profile_summary(iv, 2)
    assert p["period_us"] == pytest.approx(110.0)  # span 220 / 2
    assert p["busy_us"] == pytest.approx(100.0)  # the memset inside the first kernel
    assert p["idle_us"] == pytest.approx(10.0)
    assert p["kernels"]["gemm_rs_kernel"] == (2, pytest.approx(100.0))
    assert bench_dist.profile_summary([], 2)["period_us"] == 0.0
    text = bench_dist.format_profiles([("M=8 N=8 K/rank=8 world=2 procs", "tilewire", p)], 2)
    assert "tilewire" in text and "gemm_rs_kernel 2 x 100.0" in text
    assert bench_dist.format_profiles([]) == ""


def test_device_intervals_keeps_device_events():
    class R:
        def __init__(self, s, e):
            self.start, self.end = s, e

    class E:
        def __init__(self, kind, name, s, e):
            self.device_type, self.name, self.time_range = kind, name, R(s, e)

    ev = [E("DeviceType.CPU", "aten::mm", 0, 5), E("DeviceType.CUDA", "k", 1, 3)]
    assert _dist_sweep._device_intervals(ev) == [(1.0, 3.0, "k")]
    assert bench_dist._parser().parse_args(["--profile"]).profile


def test_tensor_map_encoder_is_optional():
    # without a driver (CI) there is no encoder and --host leaves its row out
    enc = _dist_sweep._tensor_map_encoder(0, 128, 64)
    assert enc is None or callable(enc)


def test_graph_option():
    p = bench_dist._parser()
    assert p.parse_args([]).graph == 0
    assert p.parse_args(["--graph", "10", "--op", "gemm_ar"]).graph == 10


def test_timed_calls_fill_min_ms_for_short_calls():
    # long calls: exactly --repeats
    assert bench_dist.timed_calls(20, 20.0, 2.0) == 20
    # eager decode calls of 0.05 ms: enough to fill 20 ms
    assert bench_dist.timed_calls(20, 20.0, 0.05) == 400
    assert bench_dist.timed_calls(20, 20.0, 0.03) == 667  # rounded up
    # capped, and never fewer than --repeats
    assert bench_dist.timed_calls(20, 20.0, 0.001) == 2000
    assert bench_dist.timed_calls(3000, 20.0, 0.001) == 3000
    # --min-ms 0: exactly --repeats (at least one)
    assert bench_dist.timed_calls(20, 0.0, 0.05) == 20
    assert bench_dist.timed_calls(0, 0.0, 0.05) == 1


# ---- the moe op ------------------------------------------------------------------------------


def test_moe_shapes_labels_and_checks():
    assert "moe" in bench_dist.OPS
    full = bench_dist.shapes("moe")
    assert full == [("decode", 64, 4096, 7168, 256, 8), ("dsv3-gate-up", 512, 4096, 7168, 256, 8),
                    ("dsv3-gate-up", 4096, 4096, 7168, 256, 8),
                    ("mixtral", 1024, 28672, 4096, 8, 2)]
    quick = bench_dist.shapes("moe", quick=True)
    assert len(quick) >= 2 and all(s[1] * s[2] * s[3] < 4096 * 4096 * 7168 for s in quick)
    # every sweep shape runs on 1, 2 and 8 ranks
    for world in (1, 2, 8):
        assert [bench_dist.check_shape("moe", s, world) for s in full + quick] == [None] * 6
    # --m/--n/--k: m = tokens per rank, n = n_out, k = hidden; E and top-k from the options
    assert bench_dist.shapes("moe", one=(512, 4096, 7168)) == [("", 512, 4096, 7168, 256, 8)]
    assert bench_dist.shapes("moe", one=(8, 16, 32), experts=4, top_k=1) == [
        ("", 8, 16, 32, 4, 1)]
    assert bench_dist.shape_label("moe", full[1], 8) == \
        "T=512/rank H=7168 N=4096 E=256 top8 w=8 procs dsv3-gate-up"
    assert bench_dist.shape_label("moe", ("", 8, 16, 32, 4, 1), 1) == \
        "T=8/rank H=32 N=16 E=4 top1 w=1 procs"
    check = bench_dist.check_shape
    assert "multiple of world=3" in check("moe", full[0], 3)
    assert "T (tokens per rank) must be positive" in check("moe", ("", 0, 64, 64, 8, 2), 1)
    assert "multiples of 8" in check("moe", ("", 8, 60, 64, 8, 2), 1)
    assert "multiples of 8" in check("moe", ("", 8, 64, 0, 8, 2), 1)
    assert "E=2048 must be 1 .. 1024" in check("moe", ("", 8, 64, 64, 2048, 2), 1)
    assert "top-k=9 must be 1 .. 16 and at most E=8" in check("moe", ("", 8, 64, 64, 8, 9), 1)
    assert "top-k=0" in check("moe", ("", 8, 64, 64, 8, 0), 1)
    assert "torch._grouped_mm takes at most 1023 groups" in check(
        "moe", ("", 8, 64, 64, 1024, 8), 1)
    assert check("moe", ("", 8, 64, 64, 1024, 8), 2) is None
    args = bench_dist._parser().parse_args(["--op", "moe", "--experts", "64", "--top-k", "4"])
    assert (args.op, args.experts, args.top_k) == (["moe"], 64, 4)
    assert bench_dist._parser().parse_args([]).experts == 256


def _moe_times():
    return {"torch": (2.0, 1.9, 2.1), "gemm-alone": (1.2, 1.2, 1.2),
            "nccl-alltoall": (0.6, 0.6, 0.6), "unfused": (1.6, 1.5, 1.7),
            "grouped-gemm": (1.1, 1.1, 1.1), "dispatch": (0.4, 0.4, 0.4),
            "fused": (1.25, 1.2, 1.3)}


def test_moe_rows_against_torch():
    label = "T=8/rank H=32 N=16 E=4 top1 w=2 procs"
    rows = bench_dist.make_rows("moe", label, 3e12, _moe_times(),
                                {"fused": True, "torch": False})
    by = {r["variant"]: r for r in rows}
    assert list(by) == list(_moe_times()) + ["bound"]  # no bound-bf16
    assert by["torch"]["speedup"] == pytest.approx(1.0)  # the baseline
    assert by["fused"]["speedup"] == pytest.approx(2.0 / 1.25)
    assert by["unfused"]["speedup"] == pytest.approx(2.0 / 1.6)
    # overlap and bound from torch's pieces: its grouped GEMM and its exchanges
    assert by["fused"]["overlap"] == pytest.approx(1.2 / 1.25)
    assert by["unfused"]["overlap"] == 0.0
    assert by["bound"]["ms"] == pytest.approx(1.2)
    assert by["bound"]["speedup"] == pytest.approx(1.8 / 1.2)
    assert by["fused"]["tflops"] == pytest.approx(3e12 / 1.25e-3 / 1e12)
    assert by["grouped-gemm"]["tflops"] > 0 and by["gemm-alone"]["tflops"] > 0
    assert by["nccl-alltoall"]["tflops"] == 0 and by["dispatch"]["tflops"] == 0
    assert by["torch"]["ok"] is False and by["fused"]["ok"] is True
    assert by["unfused"]["ok"] is True
    yard = {r["variant"]: r for r in bench.bound_rows({"rows": rows})}
    assert list(yard) == ["fused"]
    assert yard["fused"]["of_bound"] == pytest.approx((2.0 / 1.25) / 1.5)
    assert "nccl-alltoall" in bench.format_table({"meta": {}, "rows": rows})


def _moe_case(world, tokens, experts, top_k, seed):
    """Per rank: x bf16 [tokens, 16] (x[t] = the row's id in column 0, exact in bf16 for these
    sizes) and a routing; every rank's routing stacked [world, tokens, top_k]."""
    torch = pytest.importorskip("torch")
    from tilewire import _dist_rank

    xs = [torch.randn(tokens, 16).to(torch.bfloat16) for _ in range(world)]
    for s in range(world):
        xs[s][:, 0] = s * tokens + torch.arange(tokens)
    idxs = [_dist_rank.moe_routing(tokens, experts, top_k, seed + s, "cpu")
            for s in range(world)]
    return xs, idxs, torch.stack(idxs)


@pytest.mark.parametrize("world,tokens,experts,top_k", [(1, 40, 8, 2), (3, 37, 6, 2),
                                                        (4, 50, 16, 5)])
def test_moe_routing_and_layouts(world, tokens, experts, top_k):
    """moe_routing: distinct experts per token, seeded. PyTorch's dispatch (moe_send, the
    exchange simulated, moe_group) groups each local expert's rows from its offs, by source
    then token, padded with zero rows to 8; tw_slot_rows gives tilewire.h's layout (as a loop
    over experts, sources and tokens builds it) and ids naming the same (token, slot) as the
    rows PyTorch's pipeline moved."""
    torch = pytest.importorskip("torch")
    from tilewire import _dist_rank

    xs, idxs, every = _moe_case(world, tokens, experts, top_k, 90)
    for idx in idxs:
        assert idx.dtype == torch.int32 and idx.shape == (tokens, top_k)
        assert (idx.sort(dim=1).values.diff(dim=1) > 0).all()  # distinct
        assert idx.min() >= 0 and idx.max() < experts
    assert torch.equal(_dist_rank.moe_routing(tokens, experts, top_k, 90, "cpu"), idxs[0])
    local = experts // world
    sent = [_dist_rank.moe_send(xs[s], idxs[s], experts) for s in range(world)]
    for s, (send, counts, order) in enumerate(sent):
        assert torch.equal(counts, torch.bincount(idxs[s].reshape(-1).long(), minlength=experts))
        assert (idxs[s].reshape(-1)[order].diff() >= 0).all()  # sorted by expert
        assert torch.equal(send, xs[s][order // top_k])
    for d in range(world):
        # rank d's arrivals: every source's rows for d's experts, in rank order
        cut = [(counts[:d * local].sum().item(), counts[:(d + 1) * local].sum().item())
               for _, counts, _ in sent]
        got = torch.cat([send[a:b] for (send, _, _), (a, b) in zip(sent, cut)])
        got_counts = torch.cat([c[d * local:(d + 1) * local] for _, c, _ in sent])
        dest, offs, cap = _dist_rank.moe_group(got_counts, world, local, got.shape[0])
        assert offs.dtype == torch.int32 and offs.shape == (local,) and cap > int(offs[-1])
        grouped = torch.zeros(cap, 16, dtype=torch.bfloat16).index_copy_(0, dest, got)
        tw_offsets, lens, start = [0], [], 0
        for el in range(local):
            e = d * local + el
            want = [(s, t) for s in range(world) for t in range(tokens)
                    if (idxs[s][t] == e).any()]
            end = int(offs[el])
            assert end % 8 == 0 and end - start == -(-len(want) // 8) * 8
            ids_here = [int(v) for v in grouped[start:start + len(want), 0].float()]
            assert ids_here == [s * tokens + t for s, t in want], "expert %d's rows" % e
            assert torch.count_nonzero(grouped[start + len(want):end]) == 0  # padding
            lens.append(len(want))
            tw_offsets.append(tw_offsets[-1] + -(-len(want) // 128) * 128)
            start = end
        # tilewire's layout: the same pairs, from each expert's multiple of 128
        offsets = torch.tensor(tw_offsets, dtype=torch.int32)
        rows, ids, counts = _dist_rank.tw_slot_rows(every, d, local, offsets)
        assert counts.tolist() == lens
        expect_rows, expect_ids = [], []
        for el in range(local):
            row = tw_offsets[el]
            for s in range(world):
                for t in range(tokens):
                    j = (idxs[s][t] == d * local + el).nonzero()
                    if len(j):
                        expect_rows.append(row)
                        expect_ids.append((s * tokens + t) * top_k + int(j[0, 0]))
                        row += 1
        assert rows.tolist() == expect_rows and ids.tolist() == expect_ids
        # the ids name the (token, slot) whose x row PyTorch's pipeline moved there
        at = {}
        for r in range(int(offs[-1])):
            if grouped[r].any():
                at[int(grouped[r, 0].float())] = r
        for i in ids.tolist():
            s, t = divmod(i // top_k, tokens)
            assert torch.equal(grouped[at[s * tokens + t]], xs[s][t])


def test_torch_moe_on_one_rank():
    """The whole torch_moe at world 1 (gloo on the CPU, torch._grouped_mm's CPU path): each
    grouped row is x's row of the (token, slot) its id names, its output that row times its
    expert's weights."""
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    from tilewire import _dist_rank

    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group of the test process")
    tokens, experts, top_k, hidden, n_out = 40, 8, 2, 16, 24
    x = torch.randn(tokens, hidden).to(torch.bfloat16)
    w = (torch.randn(experts, n_out, hidden) / 4).to(torch.bfloat16)
    idx = _dist_rank.moe_routing(tokens, experts, top_k, 5, "cpu")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        try:
            st = _dist_rank.torch_moe(dist, x, idx, w, 1, ids=torch.arange(tokens * top_k))
        except (NotImplementedError, RuntimeError) as e:  # a torch without these on the CPU
            pytest.skip("torch_moe on the CPU: %s" % e)
    finally:
        dist.destroy_process_group()
    ids, offs = st["ids"], st["offs"].tolist()
    assert sorted(ids[ids >= 0].tolist()) == list(range(tokens * top_k))
    group = torch.bucketize(torch.arange(ids.numel()), torch.tensor(offs), right=True)
    for r in (ids >= 0).nonzero(as_tuple=True)[0].tolist():
        t, j = divmod(int(ids[r]), top_k)
        e = int(idx[t, j])
        assert torch.equal(st["grouped"][r], x[t]) and int(group[r]) == e
        ref = x[t].float() @ w[e].float().t()
        assert (st["out"][r].float() - ref).abs().max() <= 1e-2 * ref.abs().max() + 1e-3
    assert torch.count_nonzero(st["grouped"][ids < 0]) == 0
    assert torch.equal(st["got"], st["send"])  # one rank: its rows come back unchanged
