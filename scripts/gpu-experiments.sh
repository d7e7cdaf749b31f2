#!/usr/bin/env bash
# The open questions of docs/PERF.md as one short device run (about 3 minutes):
#   scripts/gpu-experiments.sh            logs under $OUT (default ./gpu-experiments-out),
#                                         bundled into experiments.tgz, a summary printed last
#   TW_BUILD_DIR=build-dev                where tw-bench and libtilewire.so are (default build)
# Killed by a signal, it still bundles what it has and prints the summary so far.
# Fifth session (docs/PERF.md, fourth session, "open"):
# 1. The stalls: 8 virtual ranks, tw_gemm_ar with single-column bands (TW_RS_BAND=1) at
#    flux-tp8 and M=16384 (the suite's 8-rank GEMM+AR step did not finish with them), and
#    test_gemm_rs with TW_RS_INTERLEAVE=1 (hung 4 runs of 4): with TW_WAIT_TIMEOUT_MS=3000 a
#    bounded wait that expires names its flag, peer and item in the log, and TW_WATCHDOG_S=5
#    prints, for a call stuck 5 s, what each unfinished CTA does (its wait, its last tiles).
# 2. If they pass: single columns on virtual ranks (RS and AR) and interleaving on 2 GPUs,
#    alternated, for the defaults; the SM clock and power of the interleaved GEMM+RS.
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
out=${OUT:-$root/gpu-experiments-out}
bin=${TW_BUILD_DIR:-build}
mkdir -p "$out/logs"
export LD_LIBRARY_PATH="$root/$bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export CUDA_MODULE_LOADING=EAGER CUDA_DEVICE_MAX_CONNECTIONS=32 NCCL_NVLS_ENABLE=0
ngpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || echo 1)
summary=()
run() { # run NAME LIMIT CMD...: log, and a summary line of the fused rows' median ms
  local name=$1 limit=$2
  shift 2
  timeout "$limit" "$@" >"$out/logs/$name.log" 2>&1
  local rc=$?
  summary+=("$(printf '%-28s rc=%-3s %s' "$name" "$rc" "$(grep -E '^(ag_gemm|gemm_rs|gemm_ar) ' \
    "$out/logs/$name.log" | grep -E ' (fused|fused-nogather|copy-engine|tilewire[a-z0-9-]*|gemm-alone|nccl-bf16\+cublas) ' |
    awk '{for (i = 1; i <= NF; i++) if ($i ~ /^(fused|fused-nogather|copy-engine|tilewire[a-z0-9-]*|gemm-alone|nccl-bf16\+cublas)$/) printf "%s %s  ", $i, $(i + 1)}')")")
}
big_ag="--m 16384 --n 2048 --k 16384 --repeats 20 --warmup 5"
big_rs="--m 16384 --n 16384 --k 2048"
flux_rs="--m 4096 --n 12288 --k 6144"
clocks() { # clocks NAME CMD...: the command with stamps, sampled; per-variant clocks in the summary
  local name=$1
  shift
  nvidia-smi --query-gpu=index,clocks.sm,power.draw --format=csv,noheader -lms 20 2>/dev/null |
    python3 -u -c 'import sys, time
for l in sys.stdin: print("%.3f, %s" % (time.time(), l.strip()), flush=True)' >"$out/logs/$name.smi" &
  local smi=$!
  sleep 0.5
  run "$name" 150 env TW_BENCH_STAMPS=1 "$@"
  kill $smi 2>/dev/null
  pkill -f "nvidia-smi --query-gpu=index,clocks.sm" 2>/dev/null
  wait $smi 2>/dev/null
  python3 scripts/clocks_by_variant.py "$out/logs/$name.smi" "$out/logs/$name.log" >"$out/logs/$name.clocks" 2>&1
  summary+=("$(sed "s/^/  $name: /" "$out/logs/$name.clocks")")
}
trap 'tar czf "$out/experiments.tgz" -C "$out" logs; printf "%s\n" "${summary[@]}"; exit 1' TERM INT
export TW_WAIT_TIMEOUT_MS=3000
for shape in flux big; do
  args=$flux_rs
  [ $shape = big ] && args=$big_rs
  run "vranks-ar-$shape-band1" 90 env TW_BENCH_VIRTUAL=1 TW_RS_BAND=1 TW_WATCHDOG_S=5 "$bin/tw-bench" \
    gemm_ar $args --repeats 10 --warmup 3
done
run "test_gemm_rs-interleave" 60 env TW_RS_INTERLEAVE=1 TW_TEST_VERBOSE=1 TW_WATCHDOG_S=5 \
  stdbuf -oL -eL "$bin/test_gemm_rs"
for i in 1 2; do
  for band in 0 1; do
    run "vranks-rs-flux-band$band-$i" 90 env TW_BENCH_VIRTUAL=1 TW_RS_BAND=$band "$bin/tw-bench" gemm_rs \
      $flux_rs --repeats 10 --warmup 3
  done
done
if [ "$ngpus" -gt 1 ]; then
  for i in 1 2; do
    for il in 0 1; do
      run "gpus-rs-16384-il$il-$i" 90 env TW_RS_INTERLEAVE=$il "$bin/tw-bench" gemm_rs --world 2 $big_rs \
        --repeats 20 --warmup 5
    done
  done
  # The stall reading: with interleaving the fused fp32 GEMM+RS should come down to the power
  # limit's clock like the GEMM alone (it ran at 1817 MHz / 579 W against 1642 / 634 without).
  clocks gpus-rs-16384-il1-clocks env TW_RS_INTERLEAVE=1 "$bin/tw-bench" gemm_rs --world 2 $big_rs \
    --repeats 200 --warmup 5 --no-check
fi
tar czf "$out/experiments.tgz" -C "$out" logs && rm -rf "$out/logs"
printf '%s\n' "${summary[@]}"
