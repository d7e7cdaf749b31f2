#!/usr/bin/env bash
# Runs every GPU test and benchmark on a GPU machine and prints a summary table last.
#
#   scripts/gpu-suite.sh [STEP...]     steps: host gpu mps sanitizer bench multi python trace
#                                      (default: all)
#   TW_SUITE_GEMM_ARGS="--quick"       passed to the tw-bench gemm steps (e.g. to save device time)
#   TW_SUITE_BENCH_ARGS="--repeats 20"  passed to every other tw-bench step
#
# multi: when the machine has several GPUs, the benchmarks on distinct GPUs (real NVLink),
# world = number of GPUs (ring attention among them), the multi-process test with one process
# per GPU, and the ops across two virtual nodes laid over the GPUs (the verbs test double).
#
# Build: by default a fresh one from source first (in build-gpu-suite/ of the tree, or the folder
# TW_SUITE_BUILD_DIR names; emptied first; Release, -DTW_WERROR=ON), so every GPU run also
# proves that a fresh clone builds. TW_SUITE_REUSE_BUILD=DIR runs the binaries of the build
# already in DIR instead. A failed build ends the run (with its summary).
# Full logs go to $OUT (default ./gpu-suite-out): suite.log, summary.txt, failed-STEP.log,
# bench-json.tgz (tw-bench --json).
#   TW_SUITE_DEADLINE_S=400   start no step after 400 s (the rest are listed as SKIP(deadline)),
#                             so a run under a device time limit still ends with its summary
#   TW_SUITE_STEP_CAP_S=150   no step runs longer than 150 s (a stuck step then costs that,
#                             not the rest of the run); pytest prints its slowest tests and dumps
#                             the stacks of a test still running after 150 s
# Killed (SIGTERM / SIGINT, e.g. by an outer `timeout`), it stops the running step and still
# writes the summary and the bundle: a lent machine returns only a few files.
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
out=${OUT:-$root/gpu-suite-out}
if [ -n "${TW_SUITE_REUSE_BUILD:-}" ]; then
  build=$TW_SUITE_REUSE_BUILD
else
  build=${TW_SUITE_BUILD_DIR:-$root/build-gpu-suite}
fi
mkdir -p "$out"
log=$out/suite.log
: >"$log"
# Never NVLink multicast on the shared machines.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
steps=${*:-host gpu mps sanitizer bench multi python trace}
ngpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || echo 1)
# NCCL baselines (tw-bench loads libnccl at run time): the loader's copy, else PyTorch's.
if [ -z "${TW_NCCL_LIB:-}" ] && ! ldconfig -p 2>/dev/null | grep -q 'libnccl.so.2 '; then
  nccl_dir=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)
  [ -n "$nccl_dir" ] && [ -f "$nccl_dir/libnccl.so.2" ] && export TW_NCCL_LIB="$nccl_dir/libnccl.so.2"
fi
want() { case " $steps " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

summary=()
deadline=${TW_SUITE_DEADLINE_S:-0}
current= current_name=
# step NAME TIMEOUT_S CMD...: runs, logs, records PASS/FAIL/SKIP and seconds.
step() {
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS rc
  if [ "${TW_SUITE_STEP_CAP_S:-0}" -gt 0 ] && [ "$limit" -gt "$TW_SUITE_STEP_CAP_S" ]; then
    limit=$TW_SUITE_STEP_CAP_S
  fi
  if [ "$deadline" -gt 0 ] && [ $SECONDS -ge "$deadline" ]; then
    summary+=("$(printf '%-34s %-14s' "$name" 'SKIP(deadline)')")
    echo "$name: SKIP(deadline)"
    return
  fi
  echo "===== $name: $*" >>"$log"
  # In the background, so a signal to the suite is handled at once (the trap below).
  timeout --kill-after=10 "$limit" "$@" >"$out/step.log" 2>&1 &
  current=$! current_name=$name
  wait $current
  rc=$?
  current=
  cat "$out/step.log" >>"$log"
  local verdict=PASS
  if [ $rc -eq 77 ]; then verdict=SKIP; elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then verdict="TIMEOUT(${limit}s)"; elif [ $rc -ne 0 ]; then verdict="FAIL(rc=$rc)"; fi
  # A failed step's whole output also comes back on its own (the suite log can be long).
  case $verdict in PASS | SKIP) ;; *) cp "$out/step.log" "$out/failed-$(printf '%s' "$name" | tr -c 'A-Za-z0-9_.-' _).log" ;; esac
  rm -f "$out/step.log"
  echo "===== $name: $verdict in $((SECONDS - t0)) s" >>"$log"
  summary+=("$(printf '%-34s %-14s %5ss' "$name" "$verdict" "$((SECONDS - t0))")")
  echo "$name: $verdict"
}

# The summary table, and the JSON results bundled (few files come back from a lent machine).
finish() {
  # The bound table of the runs on distinct GPUs (host-side, from the JSON:
  # python/tilewire/bench.py bound_rows), before the step table.
  local f
  for f in "$out"/bench-*-gpus.json; do
    [ -e "$f" ] || continue
    PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}" python3 -c \
      'import json, sys; from tilewire import bench; sys.stdout.write(bench.format_bound_table(json.load(open(sys.argv[1]))))' \
      "$f" 2>/dev/null
  done | tee "$out/yardstick.txt"
  {
    echo
    echo "== tilewire GPU suite: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1), $(date -u +%F)"
    printf '%s\n' "${summary[@]}"
  } | tee "$out/summary.txt"
  if ls "$out"/bench-*.json >/dev/null 2>&1; then
    tar czf "$out/bench-json.tgz" -C "$out" $(cd "$out" && ls bench-*.json) && rm -f "$out"/bench-*.json
  fi
}
on_signal() {
  if [ -n "$current" ]; then
    pkill -TERM -P "$current" 2>/dev/null
    kill -TERM "$current" 2>/dev/null
    summary+=("$(printf '%-34s %-14s %5ss' "$current_name" 'KILLED(signal)' "$SECONDS")")
    [ -f "$out/step.log" ] && cat "$out/step.log" >>"$log" && mv "$out/step.log" "$out/failed-killed.log"
    echo "===== killed by a signal while a step ran" >>"$log"
  fi
  finish
  exit 1
}
trap on_signal TERM INT

{
  echo "date: $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv 2>&1
} >>"$log"

if [ -z "${TW_SUITE_REUSE_BUILD:-}" ]; then
  generator=
  command -v ninja >/dev/null && generator="-G Ninja"
  case $(cd "$build" 2>/dev/null && pwd) in "$root" | "$HOME" | /)
    echo "gpu-suite: will not empty $build for a fresh build" >&2
    exit 2
    ;;
  esac
  rm -rf "$build"
  step "build (fresh, -DTW_WERROR=ON)" 900 bash -c "cmake -S . -B '$build' $generator \
    -DCMAKE_BUILD_TYPE=Release -DTW_WERROR=ON && cmake --build '$build' -j $(nproc)"
  case ${summary[-1]} in *PASS*) ;; *)
    finish
    exit 1
    ;;
  esac
elif [ ! -x "$build/tw-bench" ]; then
  echo "gpu-suite: TW_SUITE_REUSE_BUILD=$build holds no built tw-bench" >&2
  exit 2
fi
bin=$(cd "$build" && pwd)

if want host; then
  # the Python tests run in their own step below, with the GPU settings
  step "ctest host" 600 ctest --test-dir "$build" -L host -E '^python_tests$' --output-on-failure
fi
if want gpu; then
  step "test_comm" 300 "$bin/test_comm"
  step "test_allgather" 300 "$bin/test_allgather"
  [ -x "$bin/test_gemm" ] && step "test_gemm" 400 "$bin/test_gemm"
  # the other GPU tests (tests/gpu; test_mp runs in the mps and multi steps)
  for src in tests/gpu/test_*.c*; do
    t=$(basename "${src%.*}")
    case $t in test_comm | test_allgather | test_gemm | test_mp | test_mp_nodes) continue ;; esac
    [ -x "$bin/$t" ] && step "$t" 300 "$bin/$t"
  done
fi
if want mps; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/tw-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/tw-mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if nvidia-cuda-mps-control -d >>"$log" 2>&1; then
    step "test_mp 4 procs (MPS)" 300 "$bin/test_mp" 4 100
    step "test_mp 3 procs (MPS)" 300 "$bin/test_mp" 3 30
    # world 8 with one process per rank, as on an 8-GPU node under torchrun (the ranks share
    # the lent GPUs here)
    step "test_mp 8 procs (MPS)" 300 "$bin/test_mp" 8 20
    # 2 virtual nodes x 2 processes: the rail path across processes over the verbs test double
    [ -x "$bin/test_mp_nodes" ] && step "test_mp_nodes 4 procs (MPS)" 300 "$bin/test_mp_nodes" 20
    want python && step "pytest python (GPU + MPS)" 400 env TILEWIRE_LIB="$bin/libtilewire.so" TILEWIRE_BENCH="$bin/tw-bench" TW_IBVERBS_LIB="$bin/tests/verbs_double/libtw_verbs_double.so" TW_VD_FABRIC=/tmp/tw-suite-pytest-fabric CUDA_MODULE_LOADING=EAGER CUDA_DEVICE_MAX_CONNECTIONS=32 python3 -m pytest python/tests -q -rs --durations=15 -o faulthandler_timeout=150
    # one rank's process SIGKILLed mid-call: the survivors' calls fail within a bound and their
    # contexts stay usable. Last, as an MPS client killed mid-run is the step most likely to
    # leave the daemon unwell for the steps after it.
    step "test_mp kill 4 procs (MPS)" 200 "$bin/test_mp" kill 4
    echo quit | nvidia-cuda-mps-control >>"$log" 2>&1
  else
    summary+=("$(printf '%-34s %-14s' 'mps daemon' 'FAIL(start)')")
  fi
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
elif want python; then
  # `python` without `mps`: the GPU tests without an MPS daemon, whose multi-process cases
  # then skip
  step "pytest python (GPU)" 400 env TILEWIRE_LIB="$bin/libtilewire.so" TILEWIRE_BENCH="$bin/tw-bench" TW_IBVERBS_LIB="$bin/tests/verbs_double/libtw_verbs_double.so" TW_VD_FABRIC=/tmp/tw-suite-pytest-fabric CUDA_MODULE_LOADING=EAGER CUDA_DEVICE_MAX_CONNECTIONS=32 python3 -m pytest python/tests -q -rs --durations=15 -o faulthandler_timeout=150
fi
if want multi && [ "$ngpus" -gt 1 ]; then
  step "test_mp $ngpus procs, one per GPU" 300 "$bin/test_mp" "$ngpus" 100
  step "test_allgather, ranks on distinct GPUs" 300 env TW_TEST_DEVICES=distinct "$bin/test_allgather"
  step "test_ag_gemm, ranks on distinct GPUs" 300 env TW_TEST_DEVICES=distinct "$bin/test_ag_gemm"
  step "test_gemm_rs, ranks on distinct GPUs" 300 env TW_TEST_DEVICES=distinct "$bin/test_gemm_rs"
  step "test_gemm_rs_unfused, ranks on distinct GPUs" 300 env TW_TEST_DEVICES=distinct "$bin/test_gemm_rs_unfused"
  step "test_stall, ranks on distinct GPUs" 200 env TW_TEST_DEVICES=distinct "$bin/test_stall"
  step "tw-bench flag (2 GPUs)" 120 "$bin/tw-bench" flag --json "$out/bench-flag-gpus.json"
  step "tw-bench allgather ($ngpus GPUs)" 300 "$bin/tw-bench" allgather --world "$ngpus" --json "$out/bench-allgather-gpus.json"
  step "tw-bench ag_gemm ($ngpus GPUs)" 400 "$bin/tw-bench" ag_gemm --world "$ngpus" ${TW_SUITE_BENCH_ARGS:-} --json "$out/bench-ag_gemm-gpus.json"
  for op in gemm_rs gemm_ar moe moe_combine moe_ffn ring_attention; do
    "$bin/tw-bench" --list 2>/dev/null | grep -q "^ *$op" &&
      step "tw-bench $op ($ngpus GPUs)" 400 "$bin/tw-bench" $op --world "$ngpus" ${TW_SUITE_BENCH_ARGS:-} --json "$out/bench-$op-gpus.json"
  done
  # Graph replays across the GPUs at the shape where the default mode takes the copy engine
  # eagerly (checked first) and the SMs under capture.
  step "tw-bench ag_gemm M=16384 ($ngpus GPUs, CUDA graph)" 200 env TW_BENCH_GRAPH=1 "$bin/tw-bench" \
    ag_gemm --world "$ngpus" --m 16384 --n 2048 --k 16384 --repeats 10 --warmup 3 \
    --json "$out/bench-ag_gemm-gpus-graph.json"
  # The same ops as a PyTorch job runs them: one process per GPU (launched as torchrun would),
  # against torch.matmul + torch.distributed's NCCL collectives (python/tilewire/bench_dist.py)
  want python && step "tilewire.bench_dist ($ngpus procs, one per GPU)" 400 env \
    TILEWIRE_LIB="$bin/libtilewire.so" PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}" \
    CUDA_MODULE_LOADING=EAGER NCCL_NVLS_ENABLE=0 python3 -m tilewire.bench_dist --nproc "$ngpus" \
    --repeats 20 --json "$out/bench-dist-gpus.json"
  # ring attention with rank r on GPU r (the peers' K/V over NVLink), against the unfused ring
  # and whole-sequence attention on one GPU
  want python && step "tilewire.bench_ring ($ngpus GPUs)" 300 env \
    TILEWIRE_LIB="$bin/libtilewire.so" PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}" \
    CUDA_MODULE_LOADING=EAGER python3 -m tilewire.bench_ring --world "$ngpus" --devices distinct \
    --repeats 10
  # virtual nodes laid over the real GPUs (two nodes of ngpus / 2), joined through the verbs
  # test double: the rail paths checked bitwise against their unfused pipelines, and timed
  if [ $((ngpus % 2)) -eq 0 ] && [ -f "$bin/tests/verbs_double/libtw_verbs_double.so" ]; then
    for op in ag_gemm gemm_rs gemm_ar moe moe_combine moe_ffn ring_attention; do
      "$bin/tw-bench" --list 2>/dev/null | grep -q "^ *$op" &&
        step "tw-bench $op (2 nodes x $((ngpus / 2)) GPUs, verbs double)" 400 env \
          TW_RANKS_PER_NODE=$((ngpus / 2)) TW_IBVERBS_LIB="$bin/tests/verbs_double/libtw_verbs_double.so" \
          TW_VD_FABRIC=/tmp/tw-suite-nodes-fabric TW_VD_NICS=mlx5:8 "$bin/tw-bench" $op \
          --world "$ngpus" --quick --json "$out/bench-$op-nodes-gpus.json"
    done
  fi
  # Host time per Python call of each op beside torch.matmul and NCCL's (a benchmark, no
  # threshold)
  want python && step "tilewire.bench_dist --host ($ngpus procs)" 120 env \
    TILEWIRE_LIB="$bin/libtilewire.so" PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}" \
    CUDA_MODULE_LOADING=EAGER NCCL_NVLS_ENABLE=0 python3 -m tilewire.bench_dist --nproc "$ngpus" \
    --host
fi

if want trace; then
  # TW_TRACE=1: per-call phase lines on stderr (docs/ENV.md); the step checks they appear and
  # keeps them in the log: where the fused ops spend their time, CTA by CTA. `tee -a`: a plain
  # `tee /dev/stderr` reopens the log with O_TRUNC and cuts everything before it.
  for op in ag_gemm gemm_rs gemm_ar; do # world 2: two GPUs, or two virtual ranks on one
    step "TW_TRACE=1 tw-bench $op (world 2)" 120 bash -c "TW_TRACE=1 '$bin/tw-bench' $op --world 2 \
      --repeats 2 --warmup 1 --no-check 2>&1 | tee -a /dev/stderr | grep -q 'tw trace: $op'"
  done
fi
if want bench; then
  step "tw-bench flag" 120 "$bin/tw-bench" flag --json "$out/bench-flag.json"
  step "tw-bench allgather (8 vranks)" 300 env TW_BENCH_VIRTUAL=1 "$bin/tw-bench" allgather --world 8 --json "$out/bench-allgather.json"
  step "tw-bench ag_gemm (8 vranks)" 400 env TW_BENCH_VIRTUAL=1 "$bin/tw-bench" ag_gemm ${TW_SUITE_BENCH_ARGS:-} --json "$out/bench-ag_gemm.json"
  step "tw-bench ag_gemm (world 1)" 200 "$bin/tw-bench" ag_gemm --world 1 ${TW_SUITE_BENCH_ARGS:-} --json "$out/bench-ag_gemm-w1.json"
  for op in gemm_rs gemm_ar grouped_gemm moe moe_combine moe_ffn ring_attention; do
    "$bin/tw-bench" --list 2>/dev/null | grep -q "^ *$op" &&
      step "tw-bench $op (virtual ranks)" 400 env TW_BENCH_VIRTUAL=1 "$bin/tw-bench" $op ${TW_SUITE_BENCH_ARGS:-} --json "$out/bench-$op.json"
  done
  # Every variant captured once into a CUDA graph (all eight ranks' fused calls, forks and
  # joins) and replayed: graph capture of the whole multi-rank call, and the figures without
  # the host's enqueue cost.
  for op in ag_gemm gemm_ar; do
    step "tw-bench $op --quick (8 vranks, CUDA graph)" 300 env TW_BENCH_VIRTUAL=1 TW_BENCH_GRAPH=1 \
      "$bin/tw-bench" $op --quick ${TW_SUITE_BENCH_ARGS:-} --json "$out/bench-$op-graph.json"
  done
  if "$bin/tw-bench" --list 2>/dev/null | grep -q '^ *gemm'; then
    step "tw-bench gemm" 500 "$bin/tw-bench" gemm ${TW_SUITE_GEMM_ARGS:-} --json "$out/bench-gemm.json"
    step "tw-bench gemm --sm-budget 116" 500 "$bin/tw-bench" gemm --sm-budget 116 ${TW_SUITE_GEMM_ARGS:-} --json "$out/bench-gemm-116.json"
  fi
  # the example block's training step: tilewire's layers on virtual ranks against the same
  # tensor-parallel block in PyTorch and the plain block (worlds 2, 4, 8)
  want python && step "tilewire.bench_block (virtual ranks)" 400 env \
    TILEWIRE_LIB="$bin/libtilewire.so" PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}" \
    CUDA_MODULE_LOADING=EAGER CUDA_DEVICE_MAX_CONNECTIONS=32 python3 -m tilewire.bench_block \
    --json "$out/bench-block.json"
fi

if want sanitizer; then
  if command -v compute-sanitizer >/dev/null; then
    cs="compute-sanitizer --error-exitcode=1 --target-processes all"
    step "memcheck test_allgather --small" 200 $cs --tool memcheck "$bin/test_allgather" --small
    step "racecheck test_allgather --small" 200 $cs --tool racecheck "$bin/test_allgather" --small
    step "synccheck test_allgather --small" 200 $cs --tool synccheck "$bin/test_allgather" --small
    [ -x "$bin/test_ag_gemm" ] && step "memcheck test_ag_gemm --small" 400 $cs --tool memcheck "$bin/test_ag_gemm" --small
    # the unfused pipeline's reduce kernel stores into the peers' outs (TW_AR_PEER_OUT)
    [ -x "$bin/test_gemm_rs" ] && step "memcheck test_gemm_rs --small" 400 $cs --tool memcheck "$bin/test_gemm_rs" --small
    [ -x "$bin/test_gemm_rs_unfused" ] && step "memcheck test_gemm_rs_unfused --small" 400 $cs --tool memcheck "$bin/test_gemm_rs_unfused" --small
    # every GEMM-core variant (the ping-pong loop's too), bf16 and fp32 out, checked values
    step "memcheck tw-bench gemm variants" 200 env TW_BENCH_GEMM_VARIANTS=1 TW_BENCH_GEMM_FP32=1 \
      $cs --tool memcheck "$bin/tw-bench" gemm --m 1000 --n 1000 --k 1032 --repeats 2 --warmup 1
    step "synccheck tw-bench gemm variants" 200 env TW_BENCH_GEMM_VARIANTS=1 TW_BENCH_GEMM_FP32=1 \
      $cs --tool synccheck "$bin/tw-bench" gemm --m 1000 --n 1000 --k 1032 --repeats 2 --warmup 1
  else
    summary+=("$(printf '%-34s %-14s' 'compute-sanitizer' 'SKIP(absent)')")
  fi
fi
finish
fails=$(printf '%s\n' "${summary[@]}" | grep -c -E 'FAIL|TIMEOUT|KILLED')
exit $((fails > 0))
