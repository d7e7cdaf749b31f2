#!/usr/bin/env bash
# The open performance questions of docs/PERF.md as one short device run (about 3 minutes):
#   scripts/gpu-experiments.sh            logs under $OUT (default ./gpu-experiments-out),
#                                         bundled into experiments.tgz, a summary printed last
#   TW_BUILD_DIR=build-dev                where tw-bench and libtilewire.so are (default build)
# 1. tw_ag_gemm's own-slot copy by a copy engine (TW_AG_OWN_COPY_CE=1) measured mixed in the
#    third session (one run per setting, on a card whose clocks move between runs): the same
#    runs alternated three times, on 2 GPUs (M=16384, flux-tp8) and on 8 virtual ranks.
# 2. GEMM+RS/AR with bf16 partials: the plan sizes the reduce CTAs for fp32 bytes; the sweep of
#    reduce CTAs with bf16 partials (TW_BENCH_RS_SWEEP_BF16, rows tilewire-bf16p-rN) says
#    whether fewer would do (GEMM+AR at flux-tp8 is 0.98x of the bf16 pipeline).
# 3. Where the fused GEMM+RS spends its time: TW_TRACE lines (GEMM end against the GEMM alone)
#    at flux-tp8 and M=16384 on 2 GPUs, and the band order on 8 virtual ranks.
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
flux_ag="--m 4096 --n 6144 --k 12288 --repeats 20 --warmup 5"
big_rs="--m 16384 --n 16384 --k 2048"
flux_rs="--m 4096 --n 12288 --k 6144"
if [ "$ngpus" -gt 1 ]; then
  for i in 1 2 3; do
    for ce in 0 1; do
      run "gpus-ag-16384-ce$ce-$i" 120 env TW_AG_OWN_COPY_CE=$ce "$bin/tw-bench" ag_gemm --world 2 $big_ag
      run "gpus-ag-flux-ce$ce-$i" 120 env TW_AG_OWN_COPY_CE=$ce "$bin/tw-bench" ag_gemm --world 2 $flux_ag
    done
  done
  for op in gemm_rs gemm_ar; do
    for shape in flux big; do
      args=$flux_rs
      [ $shape = big ] && args=$big_rs
      run "gpus-$op-$shape-bf16-sweep" 150 env TW_BENCH_RS_SWEEP_BF16=1 TW_BENCH_RS_REDUCE_SMS=2,4,8,14,24 \
        "$bin/tw-bench" $op --world 2 $args --repeats 10 --warmup 3
    done
  done
  run "gpus-gemm_rs-big-fp32-sweep" 150 env TW_BENCH_RS_REDUCE_SMS=2,4,8,24 "$bin/tw-bench" gemm_rs \
    --world 2 $big_rs --repeats 10 --warmup 3
  run "gpus-rs-flux-trace" 120 env TW_TRACE=1 "$bin/tw-bench" gemm_rs --world 2 $flux_rs \
    --repeats 2 --warmup 1 --no-check
  run "gpus-rs-16384-trace" 120 env TW_TRACE=1 "$bin/tw-bench" gemm_rs --world 2 $big_rs \
    --repeats 2 --warmup 1 --no-check
fi
for i in 1 2; do
  for ce in 0 1; do
    run "vranks-ag-16384-ce$ce-$i" 120 env TW_BENCH_VIRTUAL=1 TW_AG_OWN_COPY_CE=$ce "$bin/tw-bench" ag_gemm \
      --m 16384 --n 2048 --k 16384 --repeats 10 --warmup 3
  done
done
for band in 1 8; do
  run "vranks-rs-16384-band$band" 120 env TW_BENCH_VIRTUAL=1 TW_RS_BAND=$band "$bin/tw-bench" gemm_rs \
    $big_rs --repeats 5 --warmup 2
done
tar czf "$out/experiments.tgz" -C "$out" logs && rm -rf "$out/logs"
printf '%s\n' "${summary[@]}"
