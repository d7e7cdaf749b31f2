python3 -c "import tarfile;tarfile.open('build-pack/dev.txz').extractall('.')"
export CUDA_MODULE_LOADING=EAGER
B="build-dev/tw-bench gemm --m 128 --n 4096 --k 4096 --repeats 2 --warmup 1"
timeout 50 ncu --section LaunchStats --launch-count 40 $B > $OUT/ncu-list.log 2>&1; echo "list rc=$?"
grep -E "Context 1, Stream" $OUT/ncu-list.log | sed -E 's/^ +//' | awk '{print $1, $2, $3, $4}' | sort | uniq -c | sort -rn | head -8
cb=$(grep -E "Context 1, Stream" $OUT/ncu-list.log | sed -E 's/^ +//' | awk '{print $1}' | sort | uniq -c | sort -rn | awk 'NR==1{print $2}')
echo "cublas kernel: $cb"
grep -E "Grid Size|Cluster Size|Block Size|Registers Per|Shared Memory Configuration Size|Dynamic Shared" $OUT/ncu-list.log | sort | uniq -c | head -20
for k in "$cb" gemm_sm90_kernel; do
  timeout 60 ncu --kernel-name regex:"${k:0:60}" --launch-count 1 --section SpeedOfLight --section LaunchStats --section Occupancy --section MemoryWorkloadAnalysis --section WarpStateStats $B > "$OUT/ncu-${k:0:20}.log" 2>&1; echo "== $k rc=$?"
  grep -E "Duration|DRAM Throughput|L2 Cache Throughput|L1/TEX Cache Throughput|Compute \(SM\) Throughput|Memory Throughput|Grid Size|Cluster Size|Registers Per|Achieved Occupancy|Stall|Warp Cycles Per Issued|L2 Hit Rate|Mem Busy|Max Bandwidth|Dynamic Shared Memory" "$OUT/ncu-${k:0:20}.log" | sed -E 's/ +/ /g' | head -30
done
