python3 -c "import tarfile;tarfile.open('build-pack/dev.txz').extractall('.')"
export CUDA_MODULE_LOADING=EAGER CUDA_DEVICE_MAX_CONNECTIONS=32
timeout 40 build-dev/test_gemm > $OUT/test_gemm_pair.log 2>&1; echo "pair test_gemm rc=$? $(tail -1 $OUT/test_gemm_pair.log)"
grep -m3 "pairs" $OUT/test_gemm_pair.log
export LD_LIBRARY_PATH=$PWD/build-dev/pp
TW_RS_BLOCK_N=192 TW_BENCH_AB=TW_RS_OWNER_EPI=0,1 timeout 60 build-dev/pp/tw-bench gemm_rs --world 2 --m 4096 --n 12288 --k 6144 --repeats 20 --warmup 5 > $OUT/pp-ab-01.log 2>&1; echo "pp ab 0,1 rc=$?"
grep -E "tilewire" $OUT/pp-ab-01.log | tr -s ' ' | cut -c1-150
