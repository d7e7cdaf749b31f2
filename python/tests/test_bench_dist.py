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
