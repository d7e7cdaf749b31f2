#!/usr/bin/env python3
"""Where a kernel's warps stall, by SASS instruction, from ncu's source page.

    ncu --kernel-name regex:gemm_sm90 --launch-count 1 --section WarpStateStats \
        --section SourceCounters -o rep tw-bench gemm --m 128 --n 4096 --k 4096 --repeats 2
    ncu -i rep.ncu-rep --page source --print-source sass --csv > rep.csv
    python3 scripts/ncu_top.py rep.csv

Prints the warp-stall samples and the executed instructions summed by opcode, then the 40
instructions with the most samples (address, executions, SASS). The thirty-fourth session read
tw_gemm's producer loop and cuBLAS's decode kernel with it (docs/PERF.md).
"""
import csv
import sys
import collections
if len(sys.argv) != 2:
    sys.exit(__doc__)
rows = list(csv.reader(open(sys.argv[1], errors="replace")))
# find header row: contains "Source"
hi = next(i for i, r in enumerate(rows) if any(c.strip() == "Source" for c in r))
h = [c.strip() for c in rows[hi]]
print("columns:", h[:40])
def col(sub):
    for i, c in enumerate(h):
        if sub.lower() in c.lower():
            return i
    return None
src = h.index("Source")
samp = col("Warp Stall Sampling (All")
exe = col("Instructions Executed")
if samp is None:
    print("no stall column"); sys.exit(0)
data = []
for r in rows[hi + 1:]:
    if len(r) <= max(src, samp):
        continue
    try:
        v = float(r[samp].replace(",", "") or 0)
    except ValueError:
        continue
    e = r[exe] if exe is not None and exe < len(r) else ""
    data.append((v, r[src].strip(), e, r[0]))
tot = sum(d[0] for d in data)
print("instructions", len(data), "samples", tot)
byop = collections.Counter()
for v, s, e, a in data:
    byop[s.split()[0] if s and not s.startswith("@") else " ".join(s.split()[:2])] += v
print("by opcode (top 25):")
for op, v in byop.most_common(25):
    print("  %6.1f%%  %s" % (100 * v / max(tot, 1), op))
bye = collections.Counter()
for v, s_, e, a in data:
    try:
        n = float(e.replace(",", "") or 0)
    except ValueError:
        n = 0
    bye[s_.split()[0] if s_ and not s_.startswith("@") else " ".join(s_.split()[:2])] += n
te = sum(bye.values())
print("executed (warp-level) by opcode, total %.0f (top 25):" % te)
for op, v in bye.most_common(25):
    print("  %6.1f%%  %10.0f  %s" % (100 * v / max(te, 1), v, op))
print("top 40 instructions:")
for v, s, e, a in sorted(data, reverse=True)[:40]:
    print("  %6.1f%%  exec %10s  %s  %s" % (100 * v / max(tot, 1), e, a, s[:90]))
