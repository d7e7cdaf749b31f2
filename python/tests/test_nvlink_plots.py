"""scripts/nvlink_plots.py on synthetic tw-bench JSON (no GPU): the plots and the combined JSON
are named by the runs' world and GPU, every speedup is over the fp32 nccl+cublas row of its
shape, and files of different worlds are refused."""

import json
import subprocess
import sys

import pytest


def _doc(world, op="gemm_rs"):
    shape = "M=4096 N=4096 K/rank=512 world=%d" % world
    rows = [{"op": op, "shape": shape, "variant": v, "ms": ms, "ms_p10": ms, "ms_p90": ms,
             "tflops": 0.0, "gbps": 0.0, "speedup": 1.0, "overlap": 0.0, "ok": True}
            for v, ms in (("nccl+cublas", 2.0), ("tilewire", 1.0), ("gemm-alone", 0.9))]
    meta = {"tool": "tw-bench", "date": "2026-12-01 00:00:00 +0000", "gpu": "NVIDIA H200",
            "world": world}
    return {"meta": meta, "rows": rows}


def _run(root, tmp_path, docs):
    paths = []
    for i, d in enumerate(docs):
        p = tmp_path / ("in%d.json" % i)
        p.write_text(json.dumps(d))
        paths.append(str(p))
    out = tmp_path / "plots"
    return out, subprocess.run([sys.executable, str(root / "scripts" / "nvlink_plots.py"),
                                "--note", "test", "--out", str(out)] + paths,
                               capture_output=True, text=True)


@pytest.mark.parametrize("world", [2, 8])
def test_named_by_world_and_gpu(root, tmp_path, world):
    pytest.importorskip("matplotlib")
    out, r = _run(root, tmp_path, [_doc(world)])
    assert r.returncode == 0, r.stderr
    name = "nvlink-%dxH200" % world
    doc = json.loads((out / (name + ".json")).read_text())
    assert (out / (name + "-gemm_rs.png")).stat().st_size > 5000
    assert {r["variant"]: r["speedup"] for r in doc["rows"]} == {"nccl+cublas": 1.0,
                                                                  "tilewire": 2.0}
    assert "--world %d" % world in doc["meta"]["command"]


def test_one_world_per_plot(root, tmp_path):
    out, r = _run(root, tmp_path, [_doc(2), _doc(8, "gemm_ar")])
    assert r.returncode != 0 and "one world per plot" in r.stderr
    out, r = _run(root, tmp_path, [_doc(1)])
    assert r.returncode != 0 and "not a multi-rank tw-bench run" in r.stderr
