#!/usr/bin/env bash
# ASan + UBSan over the C libraries: the C tests (run.sh --sanitize), then the native engine's
# Python tests (tests/io/test_native*.py) on sanitized builds of csrc/io_native/, compiled by
# tests/io/native_build.py (NATIVE_TESTS_SANITIZE=1) and loaded into an uninstrumented Python
# with libasan preloaded. Any sanitizer report fails the run: the programs stop at the first one
# (abort_on_error, -fno-sanitize-recover), and every report is also written to a log that this
# script checks at the end, so one from a child process cannot go unnoticed.
#
#   csrc/tests/sanitize.sh [python]    (default: .venv/bin/python, else python3)
set -euo pipefail
cd "$(dirname "$0")/../.."

python=${1:-.venv/bin/python}
[ -x "$python" ] || python=python3

csrc/tests/run.sh --sanitize

libasan=$("${CC:-cc}" -print-file-name=libasan.so)
if [ ! -e "$libasan" ]; then
    echo "sanitize.sh: the compiler has no libasan.so ($libasan)" >&2
    exit 1
fi
logs=$(mktemp -d "${TMPDIR:-/tmp}/offloadd-sanitize-XXXXXX")
trap 'rm -rf "$logs"' EXIT

# detect_leaks=0: CPython keeps memory for the life of the process, which LeakSanitizer reports
rc=0
NATIVE_TESTS_SANITIZE=1 LD_PRELOAD="$libasan" \
    ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:log_path=$logs/asan" \
    UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:log_path=$logs/ubsan" \
    "$python" -m pytest -p no:cacheprovider -q -n 0 \
    tests/io/test_native.py tests/io/test_native_faults.py || rc=$?

if compgen -G "$logs/*" >/dev/null; then
    echo "sanitize.sh: sanitizer reports:" >&2
    cat "$logs"/* >&2
    rc=1
fi
exit $rc
