#!/usr/bin/env bash
# Packs a build for the GPU machine: the library, tw-bench, tw-info, tw-rbench, tw-llbench, the test
# binaries and any probe_* (scripts/probes, built by hand into BUILD) of BUILD (default build;
# the suite runs the GPU ones), stripped, as build-dev/ inside one xz archive, build-pack/dev.txz
# (about 7 MB; the stripped binaries are ~60 MB, which with the tracked tree pass the device
# tool's 64 MiB carry limit). Carry build-pack and unpack it
# there first:
#   python3 -c "import tarfile; tarfile.open('build-pack/dev.txz').extractall('.')"
#   TW_BUILD_DIR=build-dev scripts/gpu-suite.sh ...
# Usage: scripts/pack-build.sh [BUILD] [EXTRA_BUILD NAME]...
#   each EXTRA_BUILD NAME pair adds that build's library, tw-bench and test_gemm_rs as NAME/
#   (an A/B of two builds: run NAME's binaries with LD_LIBRARY_PATH=NAME).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
build=${1:-build}
shift || true
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/build-dev"
cp -a "$build"/libtilewire.so* "$stage/build-dev/"
for b in "$build"/tw-bench "$build"/tw-info "$build"/tw-rbench "$build"/tw-llbench "$build"/test_* \
  "$build"/probe_*; do
  if [ -f "$b" ] && [ -x "$b" ]; then cp "$b" "$stage/build-dev/"; fi
done
while [ $# -ge 2 ]; do
  mkdir -p "$stage/$2"
  cp -a "$1"/libtilewire.so* "$stage/$2/"
  for b in tw-bench test_gemm_rs; do
    if [ -x "$1/$b" ]; then cp "$1/$b" "$stage/$2/"; fi
  done
  shift 2
done
find "$stage" -type f -exec strip --strip-unneeded {} + 2>/dev/null || true
mkdir -p build-pack
tar -C "$stage" -cJf build-pack/dev.txz .
ls -la build-pack/dev.txz
