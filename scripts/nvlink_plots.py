#!/usr/bin/env python3
"""Redraw the README's 2-GPU plots from a suite's tw-bench JSON files.

    python3 scripts/nvlink_plots.py --note "twenty-fourth session, commit 1a7eb20" \
        bench-ag_gemm-gpus.json bench-gemm_rs-gpus.json bench-gemm_ar-gpus.json

Keeps the rows the README shows (tilewire with fp32 and bf16 partials, ag_gemm's modes, the
NCCL + cuBLAS pipelines and the overlap bounds), sets every speedup over the fp32
nccl+cublas row of its shape, writes docs/plots/nvlink-2xH200.json and draws
docs/plots/nvlink-2xH200-OP.png with `python -m tilewire.bench --plot`.
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


def merge(paths, note):
    rows, meta = [], None
    for path in paths:
        doc = json.loads(pathlib.Path(path).read_text())
        if meta is None:
            meta = dict(doc.get("meta", {}))
        if doc.get("meta", {}).get("world") != 2:
            sys.exit("%s: not a 2-rank tw-bench run (meta.world %r)"
                     % (path, doc.get("meta", {}).get("world")))
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
    meta["command"] = ("scripts/nvlink_plots.py over the suite's tw-bench OP --world 2 JSON (%s); "
                       "every speedup here is over the fp32 nccl+cublas row of its shape" % note)
    return {"meta": meta, "rows": rows}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", nargs="+", help="tw-bench --world 2 --json files")
    ap.add_argument("--note", required=True, help="session and commit, for the JSON's meta")
    ap.add_argument("--out", default=str(ROOT / "docs" / "plots"), help="output folder")
    args = ap.parse_args()
    doc = merge(args.json, args.note)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    combined = out / "nvlink-2xH200.json"
    combined.write_text(json.dumps(doc, indent=1) + "\n")
    tmp = out / ".nvlink-plots"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    subprocess.run([sys.executable, "-m", "tilewire.bench", "--plot", str(combined),
                    "--out", str(tmp)], check=True, env=env)
    for png in sorted(tmp.glob("*.png")):
        png.replace(out / ("nvlink-2xH200-" + png.name))
    for leftover in tmp.iterdir():
        leftover.unlink()
    tmp.rmdir()
    print("wrote", combined, "and", ", ".join(sorted(p.name for p in out.glob("nvlink-2xH200-*.png"))))


if __name__ == "__main__":
    main()
