#!/usr/bin/env bash
set -u
export LD_LIBRARY_PATH=$PWD/build-dev CUDA_MODULE_LOADING=EAGER CUDA_DEVICE_MAX_CONNECTIONS=32 NCCL_NVLS_ENABLE=0
L=$OUT/logs; mkdir -p $L
sum=()
r() { local n=$1 lim=$2; shift 2; local t0=$SECONDS; timeout $lim "$@" > $L/$n.log 2>&1; local rc=$?; sum+=("$(printf '%-34s rc=%-3s %4ss' $n $rc $((SECONDS-t0)))"); echo "$n rc=$rc"; }
B=build-dev/tw-bench
big="--m 16384 --n 16384 --k 2048"; flux="--m 4096 --n 12288 --k 6144"
r test_gemm_rs 200 build-dev/test_gemm_rs
r gpus-rs 150 $B gemm_rs --world 2 --repeats 20 --warmup 5
r gpus-ar 150 $B gemm_ar --world 2 --repeats 20 --warmup 5
for b in 1 4 16; do
r gpus-rs-band$b 100 env TW_RS_BAND=$b $B gemm_rs --world 2 --repeats 10 --warmup 3
done
r rs-16384-trace 100 env TW_TRACE=1 $B gemm_rs --world 2 $big --repeats 2 --warmup 1 --no-check
r vr-rs 150 env TW_BENCH_VIRTUAL=1 $B gemm_rs --repeats 10 --warmup 3
r vr-ar 150 env TW_BENCH_VIRTUAL=1 $B gemm_ar --repeats 10 --warmup 3
tar czf $OUT/run4.tgz -C $OUT logs && rm -rf $L
printf '%s\n' "${sum[@]}"
