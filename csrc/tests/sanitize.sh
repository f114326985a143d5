#!/usr/bin/env bash
# ASan + UBSan over the C libraries: the C tests (run.sh --sanitize), then the native engine's
# Python tests (tests/io/test_native*.py) on sanitized builds of csrc/io_native/, compiled by
# tests/io/native_build.py (NATIVE_TESTS_SANITIZE=1) and loaded into an uninstrumented Python
# with libasan preloaded, then the saved-tensor hooks' tests (the tally's, tier keep's) on a
# sanitized build of csrc/hot_path/ (held.c, and passing.c: relay's pair, whose tests run too),
# which tests/_support/held_build.py loads in place of the installed offloadd.runtime._held
# (HELD_TESTS_BUILD). Any sanitizer report fails the
# run: the programs stop at the first one (abort_on_error, -fno-sanitize-recover), and every
# report is also written to a log that this script checks at the end, so one from a child
# process cannot go unnoticed.
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

# the hooks run inside autograd, which throws C++ exceptions through them (an unpack that
# raises): libstdc++ preloaded too, so that ASan's __cxa_throw interceptor finds the real one
held="$logs/held/_held$("$python" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
mkdir -p "$logs/held"
"${CC:-cc}" -std=gnu11 -O1 -g -Wall -fPIC -shared -fsanitize=address,undefined \
    -fno-sanitize-recover=all -fno-omit-frame-pointer \
    -I"$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" \
    csrc/hot_path/held.c csrc/hot_path/passing.c -o "$held"
libstdcxx=$("${CXX:-c++}" -print-file-name=libstdc++.so.6)
HELD_TESTS_BUILD="$held" LD_PRELOAD="$libasan $libstdcxx" PYTHONMALLOC=malloc \
    ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:log_path=$logs/asan" \
    UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:log_path=$logs/ubsan" \
    "$python" -m pytest -p no:cacheprovider -p tests._support.held_build -q -n 0 \
    tests/runtime/test_tally_outputs.py tests/runtime/test_tally_edges.py \
    tests/runtime/test_lean.py tests/runtime/test_threads.py tests/relay/test_relay_pass.py \
    || rc=$?

if compgen -G "$logs/*san*" >/dev/null; then
    echo "sanitize.sh: sanitizer reports:" >&2
    cat "$logs"/*san* >&2
    rc=1
fi
exit $rc
