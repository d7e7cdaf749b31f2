#!/usr/bin/env bash
# The open performance questions of docs/PERF.md as one short device run (about 2 minutes):
#   scripts/gpu-experiments.sh            logs under $OUT (default ./gpu-experiments-out),
#                                         bundled into experiments.tgz, a summary printed last
#   TW_BUILD_DIR=build-dev                where tw-bench and libtilewire.so are (default build)
# 1. Why the fused AllGather+GEMM trails the plain GEMM on 8 virtual ranks even without copies:
#    the kernel variants of TW_AG_VARIANT (plain GEMM's stage split, static schedule) at
#    M=16384 and flux-tp8, and TW_TRACE lines (per-CTA GEMM end, wait time).
# 2. Why GEMM+RS at flux-tp8 on two GPUs costs about GEMM + reduce: TW_TRACE lines, and
#    the pull variant (TW_RS_PULL=1); tw_gemm_ar's direct scheme (TW_AR_DIRECT) row.
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
  summary+=("$(printf '%-28s rc=%-3s %s' "$name" "$rc" "$(grep -E ' (fused|fused-nogather|tilewire|tilewire-direct|gemm-alone|nccl\+cublas) ' \
    "$out/logs/$name.log" | awk '{printf "%s %s  ", $(NF-7), $(NF-6)}')")")
}
big="--m 16384 --n 2048 --k 16384 --repeats 10 --warmup 3"
flux="--m 4096 --n 6144 --k 12288 --repeats 10 --warmup 3"
for v in 0 1 2 3; do
  run "vranks-16384-variant$v" 120 env TW_BENCH_VIRTUAL=1 TW_AG_VARIANT=$v "$bin/tw-bench" ag_gemm $big
  run "vranks-flux-variant$v" 120 env TW_BENCH_VIRTUAL=1 TW_AG_VARIANT=$v "$bin/tw-bench" ag_gemm $flux
done
for g in 4 8; do # L2 groups: 16 row blocks x 1 column in flight per rank is 64 MiB of A at K=16384
  run "vranks-16384-group$g" 120 env TW_BENCH_VIRTUAL=1 TW_AG_GROUP_M=$g "$bin/tw-bench" ag_gemm $big
done
run "vranks-16384-trace" 120 env TW_BENCH_VIRTUAL=1 TW_TRACE=1 "$bin/tw-bench" ag_gemm \
  --m 16384 --n 2048 --k 16384 --repeats 2 --warmup 1 --no-check
if [ "$ngpus" -gt 1 ]; then
  # 3. GEMM+RS/AR: tiles pushed to their owners (default) or pulled by them (TW_RS_PULL=1),
  #    and tw_gemm_ar's direct scheme (the tilewire-direct row, small-m shape).
  run "gpus-rs-push" 120 "$bin/tw-bench" gemm_rs --world 2 --repeats 20 --warmup 5
  run "gpus-rs-pull" 120 env TW_RS_PULL=1 "$bin/tw-bench" gemm_rs --world 2 --repeats 20 --warmup 5
  run "gpus-ar-pull" 120 env TW_RS_PULL=1 "$bin/tw-bench" gemm_ar --world 2 --repeats 20 --warmup 5
  run "gpus-ar" 120 "$bin/tw-bench" gemm_ar --world 2 --repeats 20 --warmup 5
  run "gpus-rs-flux-trace" 120 env TW_TRACE=1 "$bin/tw-bench" gemm_rs --world 2 \
    --m 4096 --n 12288 --k 6144 --repeats 2 --warmup 1 --no-check
  run "gpus-ag-16384-trace" 120 env TW_TRACE=1 "$bin/tw-bench" ag_gemm --world 2 \
    --m 16384 --n 2048 --k 16384 --repeats 2 --warmup 1 --no-check
fi
tar czf "$out/experiments.tgz" -C "$out" logs && rm -rf "$out/logs"
printf '%s\n' "${summary[@]}"
