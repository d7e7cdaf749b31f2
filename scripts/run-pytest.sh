#!/bin/sh
# ctest's python_tests: the Python front end's tests (python/tests) against this build's
# library. Exits 77 (ctest shows it skipped) when pytest is not installed.
#   scripts/run-pytest.sh PYTHON LIBTILEWIRE [PYTEST ARGS...]
python=${1:?usage: scripts/run-pytest.sh PYTHON LIBTILEWIRE [PYTEST ARGS...]}
lib=${2:?usage: scripts/run-pytest.sh PYTHON LIBTILEWIRE [PYTEST ARGS...]}
shift 2
cd "$(dirname "$0")/.." || exit 1
if ! "$python" -c 'import pytest' 2>/dev/null; then
  echo "pytest not installed: pip install '.[test]' or pip install pytest; the Python tests were skipped"
  exit 77
fi
# python -m tilewire.bench finds this build's tw-bench
bench=$(dirname "$lib")/tw-bench
[ -x "$bench" ] && [ -z "${TILEWIRE_BENCH:-}" ] && export TILEWIRE_BENCH="$bench"
# comms of virtual nodes reach each other through the verbs test double, where it was built
double=$(dirname "$lib")/tests/verbs_double/libtw_verbs_double.so
if [ -f "$double" ] && [ -z "${TW_IBVERBS_LIB:-}" ]; then
  export TW_IBVERBS_LIB="$double" TW_EFADV_LIB="$double"
  export TW_VD_FABRIC="${TMPDIR:-/tmp}/tw-pytest-fabric-$$"
fi
TILEWIRE_LIB=$lib exec "$python" -m pytest python/tests -q "$@"
