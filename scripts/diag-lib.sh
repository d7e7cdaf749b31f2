#!/usr/bin/env bash
# A measurement build of libtilewire.so in half a minute: gemm_rs_sm90.cu alone recompiled with
# -DTW_RS_DIAG=D (src/ops/gemm_rs_sm90.cu says what each bit removes; results are wrong, run
# tw-bench --no-check) and linked with BUILD's other objects, into OUT (default BUILD-diagD/).
# FLAGS: more nvcc flags for it (a build-time variant: D 0 and -DNAME=1 for a macro the file reads).
#   scripts/diag-lib.sh D [BUILD] [OUT] [FLAGS...]
# Then pack them beside the build for the device, where gpu-experiments.sh finds them:
#   scripts/pack-build.sh BUILD BUILD-diag4 build-dev/diag4 ...
#   TW_DIAG_LIBS="4 ..." TW_BUILD_DIR=build-dev scripts/gpu-experiments.sh
set -euo pipefail
d=${1:?usage: scripts/diag-lib.sh D [BUILD] [OUT] [FLAGS...]}
root=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${2:-$root/build}" && pwd)
out=${3:-$build-diag$d}
shift $(($# < 3 ? $# : 3))
mkdir -p "$out"
out=$(cd "$out" && pwd)
dir=$build/CMakeFiles/tilewire.dir
[ -f "$dir/objects1" ] || { echo "diag-lib.sh: $build is not a configured, built tree" >&2; exit 2; }
# The library's CUDA flags (without -Werror: a measurement build may leave variables unused).
flags=$(sed -n 's/^CUDA_FLAGS = //p' "$dir/flags.make" | sed 's/-Werror=all-warnings//')
cd "$build"
# shellcheck disable=SC2086
nvcc -forward-unknown-to-host-compiler -Dtilewire_EXPORTS --options-file "$dir/includes_CUDA.rsp" \
  $flags -DTW_RS_DIAG="$d" "$@" -x cu -c "$root/src/ops/gemm_rs_sm90.cu" -o "$out/gemm_rs_sm90.cu.o"
objs="$(tr ' ' '\n' <"$dir/objects1" | grep . | grep -v 'gemm_rs_sm90.cu.o$' | tr '\n' ' ')"
objs="$objs $out/gemm_rs_sm90.cu.o"
# link.txt with this output and these objects in place of the library's (the order kept)
link=$(sed -e "s| -o libtilewire.so.0.1.0 | -o $out/libtilewire.so.0.1.0 |" \
  -e "s|@CMakeFiles/tilewire.dir/objects1|$objs|" "$dir/link.txt")
eval "$link"
ln -sf libtilewire.so.0.1.0 "$out/libtilewire.so.0"
ln -sf libtilewire.so.0 "$out/libtilewire.so"
echo "$out/libtilewire.so.0.1.0 (TW_RS_DIAG=$d $*)"
