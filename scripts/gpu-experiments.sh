#!/usr/bin/env bash
# The open performance questions of docs/PERF.md as one short device run (about 3 minutes):
#   scripts/gpu-experiments.sh            logs under $OUT (default ./gpu-experiments-out),
#                                         bundled into experiments.tgz, a summary printed last
#   TW_BUILD_DIR=build-dev                where tw-bench and libtilewire.so are (default build)
# Fourth session:
# 1. Why the fused GEMM+RS's GEMM phase runs 1.3-1.75x the GEMM alone: the SM clock and power
#    per variant (nvidia-smi every 20 ms, aligned by TW_BENCH_STAMPS, scripts/clocks_by_variant.py)
#    at M=16384 on 2 GPUs, for GEMM+RS and AllGather+GEMM; TW_TRACE's GEMM end with pull
#    (local stores only) and with 2 reduce CTAs against the default.
# 2. tw_ag_gemm at world 1, own copy by the copy engine or not, alternated three times.
# 3. 8 virtual ranks: GEMM+RS at flux-tp8 with bands of 8 against the new default (1 where ranks
#    share a GPU).
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
if [ "$ngpus" -gt 1 ]; then
  clocks gpus-rs-16384-clocks "$bin/tw-bench" gemm_rs --world 2 $big_rs --repeats 200 --warmup 5 --no-check
  clocks gpus-ag-16384-clocks "$bin/tw-bench" ag_gemm --world 2 --m 16384 --n 2048 --k 16384 --repeats 150 \
    --warmup 5 --no-check
  run "gpus-rs-16384-trace" 120 env TW_TRACE=1 TW_BENCH_RS_REDUCE_SMS=2 "$bin/tw-bench" gemm_rs --world 2 \
    $big_rs --repeats 3 --warmup 1 --no-check
  run "gpus-rs-16384-trace-pull" 120 env TW_TRACE=1 TW_RS_PULL=1 "$bin/tw-bench" gemm_rs --world 2 $big_rs \
    --repeats 3 --warmup 1 --no-check
  for op in gemm_rs gemm_ar; do
    run "gpus-$op-default" 150 "$bin/tw-bench" $op --world 2 --repeats 20 --warmup 5
  done
fi
for i in 1 2 3; do
  for ce in 0 1; do
    run "world1-ag-16384-ce$ce-$i" 120 env TW_AG_OWN_COPY_CE=$ce "$bin/tw-bench" ag_gemm --world 1 $big_ag
  done
done
for band in 8 0; do
  run "vranks-rs-flux-band$band" 120 env TW_BENCH_VIRTUAL=1 TW_RS_BAND=$band "$bin/tw-bench" gemm_rs \
    $flux_rs --repeats 5 --warmup 2
done
tar czf "$out/experiments.tgz" -C "$out" logs && rm -rf "$out/logs"
printf '%s\n' "${summary[@]}"
