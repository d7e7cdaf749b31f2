"""python -m tilewire.bench_grouped on the host: its shapes and their parsing, the rows it
assembles (tilewire.bench reads them), its short table and its usage errors. The timed run
needs torch and a GPU."""

import json

import pytest

from tilewire import bench, bench_grouped


def test_default_shapes():
    assert bench_grouped.DEFAULT_SHAPES == [(32, 1024, 7168, 4096), (32, 1024, 2048, 7168),
                                            (8, 4096, 4096, 14336), (32, 128, 7168, 4096)]
    assert all(bench_grouped.check_shape(s) is None for s in bench_grouped.DEFAULT_SHAPES)
    assert bench_grouped.shape_label((32, 1024, 7168, 4096)) == "32x1024 K=7168 N=4096"
    assert bench_grouped.flops((8, 4096, 4096, 14336)) == 2.0 * 8 * 4096 * 4096 * 14336


def test_parse_shape():
    assert bench_grouped.parse_shape("32x1024,7168,4096") == (32, 1024, 7168, 4096)
    assert bench_grouped.parse_shape(" 8 x 128, 64, 72 ") == (8, 128, 64, 72)
    for text, needle in (("32x1000,64,64", "multiple of 128"), ("2x128,60,64", "multiples of 8"),
                         ("0x128,64,64", "positive"), ("32,1024,64", "EXPERTSxROWS,K,N"),
                         ("65537x128,8,8", "65536 experts")):
        with pytest.raises(ValueError, match=needle):
            bench_grouped.parse_shape(text)


def _times(grouped_mm=True):
    t = {"tilewire": (2.0, 1.9, 2.1), "dense-mm": (1.6, 1.6, 1.7)}
    if grouped_mm:
        t["torch._grouped_mm"] = (2.5, 2.4, 2.6)
    return t


def test_rows_rates_and_speedups():
    rows = bench_grouped.make_rows("4x128 K=8 N=8", 2e12, _times(), {"torch._grouped_mm": False})
    by = {r["variant"]: r for r in rows}
    assert [r["variant"] for r in rows] == ["tilewire", "torch._grouped_mm", "dense-mm"]
    assert by["tilewire"]["tflops"] == pytest.approx(1000.0)
    assert by["tilewire"]["speedup"] == pytest.approx(2.5 / 2.0)
    assert by["torch._grouped_mm"]["speedup"] == pytest.approx(1.0)
    assert by["dense-mm"]["speedup"] == pytest.approx(2.5 / 1.6)
    assert by["torch._grouped_mm"]["ok"] is False and by["tilewire"]["ok"] is True
    # tilewire.bench reads them: torch._grouped_mm is the baseline, and its table lists them
    assert bench.baseline_variant(rows) == "torch._grouped_mm"
    assert "FAIL" in bench.format_table({"meta": {}, "rows": rows})
    # a torch without torch._grouped_mm: no baseline row and no speedups
    rows = bench_grouped.make_rows("4x128 K=8 N=8", 2e12, _times(False), {})
    assert [r["variant"] for r in rows] == ["tilewire", "dense-mm"]
    assert all(r["speedup"] == 0.0 for r in rows)


def test_short_table(tmp_path):
    rows = bench_grouped.make_rows("32x1024 K=7168 N=4096", 2e12, _times(), {})
    rows += bench_grouped.make_rows("32x128 K=7168 N=4096", 2e12, _times(False), {})
    doc = {"meta": {"date": "2026-12-02", "gpu": "NVIDIA H200", "torch": "2.9",
                    "tilewire": "0.1.0"}, "rows": rows}
    path = tmp_path / "g.json"
    path.write_text(json.dumps(doc))
    text = bench_grouped.format_table(json.loads(path.read_text()))
    lines = text.splitlines()
    assert "NVIDIA H200" in lines[0] and "torch 2.9" in lines[0]
    assert "ours/grouped_mm" in lines[2] and "ours/dense" in lines[2]
    first = next(x for x in lines if x.startswith("32x1024 K=7168 N=4096"))
    assert first.split()[3:] == ["1000.0", "800.0", "1250.0", "1.25x", "0.80x", "ok"]
    second = next(x for x in lines if x.startswith("32x128 K=7168 N=4096"))
    assert second.split()[3:] == ["1000.0", "-", "1250.0", "-", "0.80x", "ok"]
    assert all(len(x) <= 100 for x in lines)
    assert "(no rows)" in bench_grouped.format_table({"rows": []})


def test_usage_errors(capsys):
    assert bench_grouped.main(["--shape", "32x100,64,64"]) == bench_grouped.EXIT_USAGE
    assert "multiple of 128" in capsys.readouterr().err
    assert bench_grouped.main(["--repeats", "0"]) == bench_grouped.EXIT_USAGE
    args = bench_grouped._parser().parse_args(["--shape", "2x128,8,8", "--shape", "4x256,16,16",
                                               "--json", "x.json", "--no-check"])
    assert args.shape == ["2x128,8,8", "4x256,16,16"] and args.json == "x.json"
    assert args.no_check and args.repeats == 100 and args.warmup == 10


def test_without_a_gpu_it_says_so(capsys):
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and torch.cuda.is_available():
        pytest.skip("a GPU is present (the run would start)")
    assert bench_grouped.main(["--shape", "2x128,8,8"]) == bench_grouped.EXIT_NO_GPU
    err = capsys.readouterr().err
    assert "needs torch" in err or "no CUDA GPU" in err
