#!/usr/bin/env python3
"""Redraw the README's multi-GPU plots from a suite's tw-bench JSON files.

    python3 scripts/nvlink_plots.py --note "twenty-fourth session, commit 1a7eb20" \
        bench-ag_gemm-gpus.json bench-gemm_rs-gpus.json bench-gemm_ar-gpus.json

Keeps the rows the README shows (tilewire with fp32 and bf16 partials, ag_gemm's modes, the
NCCL + cuBLAS pipelines and the overlap bounds), sets every speedup over the fp32
nccl+cublas row of its shape, writes docs/plots/nvlink-WxGPU.json and draws
docs/plots/nvlink-WxGPU-OP.png with `python -m tilewire.bench --plot`: W the runs' world (every
file must share it, at least 2), GPU the last word of their GPU's name (nvlink-2xH200-OP.png
for the suite's 2-GPU runs on H200s, nvlink-8xH200-OP.png on an 8-GPU node).
"""
import argparse
import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
KEEP = {"bound", "bound-bf16", "copy-engine", "fused", "fused-sm", "nccl+cublas",
        "nccl-bf16+cublas", "tilewire", "tilewire-bf16p"}


def prefix(meta):
    """nvlink-WxGPU for a run's meta: its world and the last word of its GPU's name."""
    gpu = (meta.get("gpu") or "GPU").split()[-1]
    return "nvlink-%dx%s" % (meta["world"], gpu)


def merge(paths, note):
    rows, meta = [], None
    for path in paths:
        doc = json.loads(pathlib.Path(path).read_text())
        world = doc.get("meta", {}).get("world")
        if meta is None:
            meta = dict(doc.get("meta", {}))
            if not isinstance(world, int) or world < 2:
                sys.exit("%s: not a multi-rank tw-bench run (meta.world %r)" % (path, world))
        if world != meta["world"]:
            sys.exit("%s: meta.world %r, the first file's is %r: one world per plot"
                     % (path, world, meta["world"]))
        base = {(r["op"], r["shape"]): r["ms"] for r in doc.get("rows", [])
                if r.get("variant") == "nccl+cublas" and r.get("ms", 0) > 0}
        for r in doc.get("rows", []):
            if r.get("variant") not in KEEP:
                continue
            r = dict(r)
            ref = base.get((r["op"], r["shape"]))
            if ref and r.get("ms", 0) > 0:
                r["speedup"] = ref / r["ms"]
            rows.append(r)
    meta["date"] = "%s (%s)" % (meta.get("date", "?"), note)
    meta["command"] = ("scripts/nvlink_plots.py over the suite's tw-bench OP --world %d JSON (%s); "
                       "every speedup here is over the fp32 nccl+cublas row of its shape"
                       % (meta["world"], note))
    return {"meta": meta, "rows": rows}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", nargs="+", help="tw-bench --world W --json files (one W)")
    ap.add_argument("--note", required=True, help="session and commit, for the JSON's meta")
    ap.add_argument("--out", default=str(ROOT / "docs" / "plots"), help="output folder")
    args = ap.parse_args()
    doc = merge(args.json, args.note)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = prefix(doc["meta"])
    combined = out / (name + ".json")
    combined.write_text(json.dumps(doc, indent=1) + "\n")
    tmp = out / ".nvlink-plots"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    subprocess.run([sys.executable, "-m", "tilewire.bench", "--plot", str(combined),
                    "--out", str(tmp)], check=True, env=env)
    for png in sorted(tmp.glob("*.png")):
        png.replace(out / ("%s-%s" % (name, png.name)))
    for leftover in tmp.iterdir():
        leftover.unlink()
    tmp.rmdir()
    print("wrote", combined, "and", ", ".join(sorted(p.name for p in out.glob(name + "-*.png"))))


if __name__ == "__main__":
    main()
