#!/usr/bin/env bash
# The C tests of csrc/: build each test program with the C compiler and run it.
#
#   csrc/tests/run.sh [--sanitize]
#
# --sanitize builds everything with ASan and UBSan (any report ends the program with an error).
# The programs are built in a temporary directory; their files go to $OFFLOADD_TEST_DIR, else
# /var/tmp (a disk: O_DIRECT does not work on tmpfs). The engine is built as the tests' build
# (-DOFFLOADD_FAULTS, faults.c: docs/native.md). Exit status 0 when every test passed (skips
# say why: io_uring unavailable here, say).
set -euo pipefail
cd "$(dirname "$0")/../.."

CC=${CC:-cc}
CFLAGS=(-std=gnu11 -g -Wall -Wextra -Werror -Wno-unused-parameter -pthread)
if [ "${1:-}" = "--sanitize" ]; then
    CFLAGS+=(-O1 -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer)
    export ASAN_OPTIONS=${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1}
    export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
    shift
else
    CFLAGS+=(-O2)
fi
[ $# -eq 0 ] || { echo "usage: $0 [--sanitize]" >&2; exit 2; }

out=$(mktemp -d "${TMPDIR:-/tmp}/offloadd-ctests-XXXXXX")
trap 'rm -rf "$out"' EXIT

io=csrc/io_native
engine=("$io/engine.c" "$io/posix_io.c" "$io/ring.c" "$io/uring_backend.c" "$io/faults.c")
build() { # name, then the compiler's arguments
    local name=$1
    shift
    "$CC" "${CFLAGS[@]}" -Icsrc/tests "$@" -o "$out/$name" -lm
}
build test_engine -I"$io" -DOFFLOADD_FAULTS csrc/tests/test_engine.c "${engine[@]}"
build test_ring -I"$io" -DOFFLOADD_FAULTS csrc/tests/test_ring.c "$io/ring.c" "$io/faults.c"
# the codec's flags as setup.py has them (no fused multiply-add: the torch path's results)
build test_codec -Icsrc/codec -O3 -ffp-contract=off csrc/tests/test_codec.c csrc/codec/codec.c

failed=0
for t in test_engine test_ring test_codec; do
    "$out/$t" || { echo "$t: FAILED (exit $?)"; failed=1; }
done
exit $failed
