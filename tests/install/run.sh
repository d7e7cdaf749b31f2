#!/bin/sh
# ctest's install test: `cmake --install` of BUILD into a temporary prefix, then
# tw_install_check.c built and run against it twice: with `pkg-config --cflags --libs tilewire`
# and through a CMake project's find_package(tilewire). Exits 77 after the CMake half when
# pkg-config is absent.
#   tests/install/run.sh CMAKE BUILD CC LIBDIR [GENERATOR]
set -eu
cmake=$1 build=$2 cc=$3 libdir=$4 generator=${5:-}
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/tw-install.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/prefix

"$cmake" --install "$build" --prefix "$prefix" >"$tmp/install.log" || { cat "$tmp/install.log"; exit 1; }
for f in "$libdir/libtilewire.so" include/tilewire.h "$libdir/pkgconfig/tilewire.pc" \
  "$libdir/cmake/tilewire/tilewireConfig.cmake" "$libdir/cmake/tilewire/tilewireConfigVersion.cmake" \
  "$libdir/cmake/tilewire/tilewireTargets.cmake" bin/tw-info bin/tw-bench; do
  [ -e "$prefix/$f" ] || { echo "FAIL: not installed: $f"; cat "$tmp/install.log"; exit 1; }
done
# The tools find the installed library, not the build tree's.
if command -v readelf >/dev/null; then
  for t in tw-info tw-bench; do
    readelf -d "$prefix/bin/$t" | grep -q 'R.*PATH.*\$ORIGIN/\.\./' ||
      { echo "FAIL: bin/$t has no \$ORIGIN/../ RPATH"; readelf -d "$prefix/bin/$t" | grep PATH; exit 1; }
  done
fi

echo "== find_package(tilewire)"
set -- -S "$here" -B "$tmp/consumer" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_C_COMPILER="$cc"
[ -n "$generator" ] && set -- "$@" -G "$generator"
"$cmake" "$@" >"$tmp/consumer.log" 2>&1 && "$cmake" --build "$tmp/consumer" >>"$tmp/consumer.log" 2>&1 ||
  { cat "$tmp/consumer.log"; echo "FAIL: the CMake consumer did not build"; exit 1; }
"$tmp/consumer/tw_install_check"

echo "== pkg-config"
if ! command -v pkg-config >/dev/null; then
  echo "SKIP: pkg-config not installed (the find_package half passed)"
  exit 77
fi
flags=$(PKG_CONFIG_PATH="$prefix/$libdir/pkgconfig" pkg-config --cflags --libs tilewire)
echo "pkg-config --cflags --libs tilewire: $flags"
# shellcheck disable=SC2086 # $flags is a list of words
"$cc" -std=c11 -Wall -Wextra -Werror -o "$tmp/check_pc" "$here/tw_install_check.c" $flags \
  -Wl,-rpath,"$prefix/$libdir"
"$tmp/check_pc"
