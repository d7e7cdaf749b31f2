"""python -m tilewire.bench on the host: table and plots from a synthetic tw-bench JSON, and
the driver end to end against a fake tw-bench (no GPU)."""

import json
import os
import stat
import sys
import textwrap

import pytest

from tilewire import bench


def _row(op, shape, variant, ms, speedup, tflops=0.0, gbps=0.0, ok=True, overlap=0.0):
    return {"op": op, "shape": shape, "variant": variant, "ms": ms, "ms_p10": ms * 0.98,
            "ms_p90": ms * 1.03, "tflops": tflops, "gbps": gbps, "speedup": speedup,
            "overlap": overlap, "ok": ok}


def synthetic():
    rows = []
    for i, size in enumerate((1024, 4096, 8192)):
        shape = "M=%d N=%d K=%d sms=132" % (size, size, size)
        base = 0.05 * (i + 1) ** 3
        rows.append(_row("gemm", shape, "cublas", base, 1.0, tflops=600.0))
        rows.append(_row("gemm", shape, "tilewire", base / 1.1, 1.1, tflops=660.0))
    for size in (1 << 20, 16 << 20):
        shape = "%d B/rank world=8 sms/rank=16" % size
        rows.append(_row("allgather", shape, "copy-engine", 0.2, 1.0, gbps=1500.0))
        rows.append(_row("allgather", shape, "tilewire", 0.1, 2.0, gbps=3000.0, ok=False))
    rows.append(_row("flag", "1000 round trips per launch, 2 ranks", "round-trip-us .sys",
                     0.002, 0.0))
    rows.append({"op": "gemm", "shape": "M=1 N=8 K=8", "variant": "setup-error", "ms": None,
                 "ms_p10": None, "ms_p90": None, "tflops": 0, "gbps": 0, "speedup": 0,
                 "overlap": 0, "ok": False})
    meta = {"tool": "tw-bench", "date": "2026-11-29 12:00:00 +0000", "command": "tw-bench",
            "host": "h", "gpu": "NVIDIA H200", "gpu_count": 1, "sm_count": 132,
            "compute_capability": "9.0", "driver": "13.0", "runtime": "13.0",
            "tilewire": "0.1.0"}
    return {"meta": meta, "rows": rows}


def test_table_lists_every_row_side_by_side():
    text = bench.format_table(synthetic())
    assert "NVIDIA H200 x1" in text and "132 SMs, sm_90" in text
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("op "))
    for title in ("shape", "variant", "ms", "p10-p90", "TFLOP/s", "GB/s", "speedup", "check"):
        assert title in header
    assert any("tilewire" in line and "1.10x" in line and "660.0" in line for line in lines)
    assert any("allgather" in line and "FAIL" in line for line in lines)
    assert any("setup-error" in line and " - " in line for line in lines)
    assert "12 rows, 3 failed" in text


def test_baseline_is_the_variant_at_speedup_one():
    doc = synthetic()
    gemm = [r for r in doc["rows"] if r["op"] == "gemm" and r["variant"] != "setup-error"]
    assert bench.baseline_variant(gemm) == "cublas"
    ag = [r for r in doc["rows"] if r["op"] == "allgather"]
    assert bench.baseline_variant(ag) == "copy-engine"
    flag = [r for r in doc["rows"] if r["op"] == "flag"]
    assert bench.baseline_variant(flag) is None


def test_plots_one_png_per_op(tmp_path):
    pytest.importorskip("matplotlib")
    paths = bench.plot(synthetic(), tmp_path)
    assert sorted(p.name for p in paths) == ["allgather.png", "flag.png", "gemm.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


def test_plot_only_mode(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    src = tmp_path / "in.json"
    src.write_text(json.dumps(synthetic()))
    out = tmp_path / "out"
    rc = bench.main(["--plot", str(src), "--out", str(out)])
    assert rc == 1  # synthetic rows include failures
    assert (out / "gemm.png").exists() and (out / "table.txt").exists()
    assert json.loads((out / "results.json").read_text())["rows"] == synthetic()["rows"]
    assert "12 rows, 3 failed" in capsys.readouterr().out


FAKE_BENCH = textwrap.dedent(
    """\
    #!{python}
    import json, os, sys
    OPS = {{"gemm": 3, "allgather": 2}}
    args = sys.argv[1:]
    if args == ["--list"]:
        for op, n in OPS.items():
            print("%-12s %s" % (op, "fake " + op))
            print("%-12s sweep: %d shapes, quick: 1 shapes" % ("", n))
        sys.exit(0)
    if os.environ.get("FAKE_NO_HOPPER"):
        sys.stderr.write("tw-bench: no Hopper (sm_90) GPU found: no CUDA device\\n")
        sys.exit(2)
    op = args[0]
    path = args[args.index("--json") + 1]
    n = 1 if "--quick" in args else OPS[op]
    sys.stderr.write("tw-bench fake | GPU\\n")
    rows = []
    for i in range(n):
        sys.stderr.write("[%s %d/%d] m=%d n=1 k=1 ...\\n" % (op, i + 1, n, i))
        for variant, speedup in (("base", 1.0), ("tilewire", 1.5)):
            rows.append({{"op": op, "shape": "m=%d" % i, "variant": variant, "ms": 1.0 / speedup,
                         "ms_p10": 0.9, "ms_p90": 1.1, "tflops": 100.0 * speedup, "gbps": 0,
                         "speedup": speedup, "overlap": 0, "ok": True}})
        sys.stderr.write("[%s %d/%d] 2 rows, 0 failed, 0.1 s\\n" % (op, i + 1, n))
    with open(path, "w") as f:
        json.dump({{"meta": {{"tool": "tw-bench", "gpu": "Fake GPU", "command": " ".join(args)}},
                   "rows": rows}}, f)
    print("fake table for", op)
    """
)


@pytest.fixture
def fake_bench(tmp_path):
    path = tmp_path / "tw-bench"
    path.write_text(FAKE_BENCH.format(python=sys.executable))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_driver_runs_every_listed_op(fake_bench, tmp_path, capsys):
    out = tmp_path / "out"
    rc = bench.main(["--bench", str(fake_bench), "--out", str(out), "--no-plots",
                     "--no-progress-bar"])
    assert rc == 0
    doc = json.loads((out / "results.json").read_text())
    assert [r["op"] for r in doc["rows"]] == ["gemm"] * 6 + ["allgather"] * 4
    assert [run["op"] for run in doc["meta"]["runs"]] == ["gemm", "allgather"]
    assert doc["meta"]["gpu"] == "Fake GPU"
    assert (out / "tw-bench-gemm.txt").read_text() == "fake table for gemm\n"
    captured = capsys.readouterr()
    assert "10 rows, 0 failed" in captured.out
    assert "5/5 shapes" in captured.err  # the text progress bar reached the end
    assert "tw-bench fake | GPU" in captured.err  # other stderr lines pass through


def test_driver_one_op_quick_with_plots(fake_bench, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "out"
    rc = bench.main(["gemm", "--quick", "--bench", str(fake_bench), "--out", str(out)])
    assert rc == 0
    doc = json.loads((out / "results.json").read_text())
    assert len(doc["rows"]) == 2 and "--quick" in doc["meta"]["runs"][0]["command"]
    assert (out / "gemm.png").exists() and not (out / "allgather.png").exists()


def test_driver_unknown_op_is_a_usage_error(fake_bench, tmp_path):
    rc = bench.main(["nope", "--bench", str(fake_bench), "--out", str(tmp_path)])
    assert rc == bench.EXIT_USAGE


def test_driver_no_hopper_exits_2(fake_bench, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_NO_HOPPER", "1")
    rc = bench.main(["--bench", str(fake_bench), "--out", str(tmp_path), "--no-progress-bar"])
    assert rc == bench.EXIT_NO_HOPPER


def _executable(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def test_find_bench_order(tmp_path, monkeypatch):
    # --bench, TILEWIRE_BENCH, the package's copy, beside the library in use, PATH
    from tilewire import _lib

    monkeypatch.setattr(_lib, "_PACKAGE_DIR", tmp_path / "pkg")
    monkeypatch.setattr(_lib, "_SOURCE_BUILD_DIR", tmp_path / "src" / "build")
    monkeypatch.setattr(_lib, "_loaded_path", None)
    lib = tmp_path / "libdir" / "libtilewire.so"
    lib.parent.mkdir()
    lib.write_text("")
    monkeypatch.setenv("TILEWIRE_LIB", str(lib))
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.delenv("TILEWIRE_BENCH", raising=False)
    assert bench.find_bench() is None
    message = bench.bench_not_found()
    assert "pip install ." in message and "TILEWIRE_BENCH=build/tw-bench" in message
    assert str(tmp_path / "pkg" / "tw-bench") in message
    on_path = _executable(tmp_path / "bin" / "tw-bench")
    assert bench.find_bench() == on_path
    beside = _executable(tmp_path / "libdir" / "tw-bench")
    assert bench.find_bench() == beside
    packaged = _executable(tmp_path / "pkg" / "tw-bench")
    assert bench.find_bench() == packaged
    assert "(the package's own copy)" in bench._bench_line()
    env = _executable(tmp_path / "env" / "tw-bench")
    monkeypatch.setenv("TILEWIRE_BENCH", str(env))
    assert bench.find_bench() == env
    explicit = _executable(tmp_path / "explicit" / "tw-bench")
    assert bench.find_bench(str(explicit)) == explicit
    # a named one that is not there is an error, not a reason to run another
    monkeypatch.setenv("TILEWIRE_BENCH", str(tmp_path / "absent"))
    assert bench.find_bench() is None
    assert "TILEWIRE_BENCH=%s is not an executable" % (tmp_path / "absent") in \
        bench.bench_not_found()


def test_shape_counts():
    entry = ("gemm", "", 12, 3)
    assert bench._shape_count(entry, quick=False, one_shape=False) == 12
    assert bench._shape_count(entry, quick=True, one_shape=False) == 3
    assert bench._shape_count(("x", "", 5, 0), quick=True, one_shape=False) == 1
    assert bench._shape_count(entry, quick=False, one_shape=True) == 1


def test_real_tw_bench_list_parses(root):
    exe = root / "build" / "tw-bench"
    if not (exe.exists() and os.access(exe, os.X_OK)):
        pytest.skip("build/tw-bench not built")
    ops = bench.list_ops(exe)
    assert ops and all(sweep > 0 for _, _, sweep, _ in ops)


def _gpus_doc():
    """A 2-GPU gemm_rs shape as tw-bench writes it: NCCL pipelines, pieces, bound rows."""
    shape = "M=4096 N=4096 K/rank=512 world=2 sms/rank=132"
    rows = [
        _row("gemm_rs", shape, "gemm-alone", 1.0, 1.5),
        _row("gemm_rs", shape, "nccl+cublas", 1.5, 1.0),
        _row("gemm_rs", shape, "nccl-reduce", 0.6, 2.5),
        _row("gemm_rs", shape, "tilewire", 1.2, 1.25, overlap=1.0 / 1.2),
        _row("gemm_rs", shape, "tilewire-bf16p", 1.1, 1.1, overlap=1.0 / 1.1),
        _row("gemm_rs", shape, "tilewire[TW_RS_BAND=2]", 1.0, 1.5, overlap=1.0),
        _row("gemm_rs", shape, "bound", 1.0, 1.6),
        _row("gemm_rs", shape, "bound-bf16", 1.0, 1.25),
    ]
    rows.append(_row("gemm_rs", "M=4096 world=8 sms/rank=16", "tilewire", 1.0, 1.1, overlap=0.9))
    return {"meta": synthetic()["meta"], "rows": rows}


def test_bound_rows_are_the_multi_gpu_yardstick():
    rows = bench.bound_rows(_gpus_doc())
    by = {r["variant"]: r for r in rows}
    # fp32 row against "bound", bf16-partials row against "bound-bf16"; A/B rows and shapes
    # without NCCL (virtual ranks) are left out
    assert sorted(by) == ["tilewire", "tilewire-bf16p"]
    assert by["tilewire"]["of_bound"] == pytest.approx(1.25 / 1.6)
    assert by["tilewire"]["overlap"] == pytest.approx(1.0 / 1.2)
    assert by["tilewire-bf16p"]["of_bound"] == pytest.approx(1.1 / 1.25)
    text = bench.format_bound_table(_gpus_doc())
    assert "of-bound" in text and "0.78" in text and "0.88" in text
    assert bench.format_bound_table(synthetic()) == ""


def test_plot_prints_the_yardstick(tmp_path, capsys):
    src = tmp_path / "gpus.json"
    src.write_text(json.dumps(_gpus_doc()))
    assert bench.main(["--plot", str(src), "--out", str(tmp_path / "o"), "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert "multi-GPU yardstick" in out and "of-bound" in out
    assert "of-bound" in (tmp_path / "o" / "table.txt").read_text()


def test_bound_rows_use_each_rows_own_pipeline():
    # the README's merged file rebases every speedup over fp32 NCCL; the yardstick still takes
    # the bf16-partials row against the bf16 pipeline's time
    doc = _gpus_doc()
    shape = doc["rows"][0]["shape"]
    doc["rows"].append(_row("gemm_rs", shape, "nccl-bf16+cublas", 1.32, 1.0))
    for r in doc["rows"]:
        if r["variant"] == "tilewire-bf16p":
            r["speedup"] = 1.5 / 1.1  # over fp32 NCCL
    by = {r["variant"]: r for r in bench.bound_rows(doc)}
    assert by["tilewire-bf16p"]["speedup"] == pytest.approx(1.32 / 1.1)
    assert by["tilewire-bf16p"]["of_bound"] == pytest.approx(1.32 / 1.1 / 1.25)
