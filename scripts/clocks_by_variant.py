#!/usr/bin/env python3
"""SM clock and power per tw-bench variant.

    clocks_by_variant.py SAMPLES BENCH_LOG

SAMPLES: lines "unix_seconds, gpu index, clocks.sm [MHz], power.draw [W]" (scripts/gpu-experiments.sh
takes them with nvidia-smi every 20 ms); BENCH_LOG: the output of one tw-bench shape run with
TW_BENCH_STAMPS=1 ("tw-bench stamp N start|end T" per timing, rows printed in timing order).
Prints, per timing, the variant and the mean SM clock and power of each GPU while it ran, and
the lowest clock and highest power sampled then (a throttled stretch shows as a low minimum).
"""
import re
import sys
from collections import defaultdict


def main():
    samples = []
    with open(sys.argv[1]) as f:
        for line in f:
            parts = [p.strip() for p in line.split(",")]
            if len(parts) < 4:
                continue
            try:
                t, gpu = float(parts[0]), int(parts[1])
                mhz = float(parts[2].split()[0])
                watts = float(parts[3].split()[0])
            except ValueError:
                continue
            samples.append((t, gpu, mhz, watts))
    spans = defaultdict(dict)
    rows = []
    with open(sys.argv[2]) as f:
        for line in f:
            m = re.match(r"tw-bench stamp (\d+) (start|end) ([0-9.]+)", line)
            if m:
                spans[int(m.group(1))][m.group(2)] = float(m.group(3))
                continue
            m = re.match(r"^(ag_gemm|gemm_rs|gemm_ar|gemm|allgather)\s", line)
            if m:
                words = line.split()
                known = [w for w in words if re.match(r"^[a-z][a-z0-9+-]*$", w) and w not in (
                    "ag_gemm", "gemm_rs", "gemm_ar", "gemm", "allgather", "ok", "flux-tp8", "small-m", "decode")]
                rows.append(known[0] if known else "?")
    for n in sorted(spans):
        s = spans[n]
        if "start" not in s or "end" not in s:
            continue
        per = defaultdict(list)
        for t, gpu, mhz, watts in samples:
            if s["start"] <= t <= s["end"]:
                per[gpu].append((mhz, watts))
        name = rows[n] if n < len(rows) else f"timing{n}"
        cells = []
        for gpu in sorted(per):
            v = per[gpu]
            cells.append("gpu%d %4.0f MHz %4.0f W (%d; min %4.0f MHz, max %4.0f W)" % (
                gpu, sum(x[0] for x in v) / len(v), sum(x[1] for x in v) / len(v), len(v),
                min(x[0] for x in v), max(x[1] for x in v)))
        print("%-20s %6.3f s  %s" % (name, s["end"] - s["start"], "  ".join(cells) or "no samples"))


if __name__ == "__main__":
    main()
