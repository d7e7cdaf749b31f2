#!/usr/bin/env bash
set -u
export LD_LIBRARY_PATH=$PWD/build-dev CUDA_MODULE_LOADING=EAGER CUDA_DEVICE_MAX_CONNECTIONS=32 NCCL_NVLS_ENABLE=0
L=$OUT/logs; mkdir -p $L
sum=()
r() { local n=$1 lim=$2; shift 2; local t0=$SECONDS; timeout $lim "$@" > $L/$n.log 2>&1; local rc=$?; sum+=("$(printf '%-34s rc=%-3s %4ss' $n $rc $((SECONDS-t0)))"); echo "$n rc=$rc"; }
B=build-dev/tw-bench
big="--m 16384 --n 16384 --k 2048"; flux="--m 4096 --n 12288 --k 6144"
r rs-16384-trace 100 env TW_TRACE=1 $B gemm_rs --world 2 $big --repeats 2 --warmup 1 --no-check
r rs-flux-trace 100 env TW_TRACE=1 $B gemm_rs --world 2 $flux --repeats 2 --warmup 1 --no-check
r rs-16384-sweep 150 env TW_BENCH_RS_REDUCE_SMS=2,8,30,60 $B gemm_rs --world 2 $big --repeats 10 --warmup 3
r rs-16384-nosteal 100 env TW_RS_STEAL=0 $B gemm_rs --world 2 $big --repeats 10 --warmup 3
r test_ag_gemm 200 build-dev/test_ag_gemm
r test_plans 30 build-dev/test_plans
r vr-ag 150 env TW_BENCH_VIRTUAL=1 $B ag_gemm --repeats 10 --warmup 3
tar czf $OUT/run3.tgz -C $OUT logs && rm -rf $L
printf '%s\n' "${sum[@]}"
