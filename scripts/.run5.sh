#!/usr/bin/env bash
set -u
export LD_LIBRARY_PATH=$PWD/build-dev CUDA_MODULE_LOADING=EAGER CUDA_DEVICE_MAX_CONNECTIONS=32 NCCL_NVLS_ENABLE=0
L=$OUT/logs; mkdir -p $L
sum=()
r() { local n=$1 lim=$2; shift 2; local t0=$SECONDS; timeout $lim "$@" > $L/$n.log 2>&1; local rc=$?; sum+=("$(printf '%-34s rc=%-3s %4ss' $n $rc $((SECONDS-t0)))"); echo "$n rc=$rc"; }
B=build-dev/tw-bench
big="--m 16384 --n 16384 --k 2048"; flux="--m 4096 --n 12288 --k 6144"
for s in 0 1 2 3; do
r g-big-sig$s 60 env TW_RS_SIGNAL=$s $B gemm_rs --world 2 $big --repeats 10 --warmup 3
r g-flux-sig$s 60 env TW_RS_SIGNAL=$s $B gemm_rs --world 2 $flux --repeats 10 --warmup 3
done
for s in 0 1 4 5 7; do
r v-big-sig$s 60 env TW_BENCH_VIRTUAL=1 TW_RS_SIGNAL=$s $B gemm_rs $big --repeats 5 --warmup 2
done
r g-big-pull 80 env TW_RS_PULL=1 TW_BENCH_RS_REDUCE_SMS=16,32,48 $B gemm_rs --world 2 $big --repeats 10 --warmup 3
r g-big-trace-sig1 60 env TW_TRACE=1 TW_RS_SIGNAL=1 $B gemm_rs --world 2 $big --repeats 2 --warmup 1 --no-check
TW_RS_SIGNAL=1 r test-sig1 120 env TW_RS_SIGNAL=1 build-dev/test_gemm_rs --small
r test-sig7 120 env TW_RS_SIGNAL=7 build-dev/test_gemm_rs --small
tar czf $OUT/run5.tgz -C $OUT logs && rm -rf $L
printf '%s\n' "${sum[@]}"
