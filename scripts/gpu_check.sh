#!/usr/bin/env bash
# The checks that need a CUDA GPU, for a lent GPU machine (a bare one: python3 with a CUDA torch,
# no network). Usage, from the repository root:
#
#     scripts/gpu_check.sh OUTDIR [tests] [compile] [bench] [floor] [clients] [relay] [paired]
#                                 [wall] [wall-peers]
#
# wall, wall-peers: scripts/wall_gpu.py, the memory wall of a 1.1 B Llama-style config in bf16 at
# seq 4096 inside WALL_LIMIT of device memory (default 40GiB): offloadd's strategies (plain,
# recompute, offload-cpu, auto), then the peers (sac, compile-budget, compile-offload, and
# torchtune-offload where torchtune and torchao are in .whl/); each writes OUTDIR/PART/wall.md.
# Each fills one device call: run them apart. WALL_ARGS adds options (e.g. --most 32).
# relay: relay's cuda tests and scripts/relay_gpu.py (against FSDP2's CPUOffloadPolicy); RELAY_TESTS=0
# skips the tests, RELAY_ARMS picks the arms, RELAY_WINDOW runs relay-cpu again at that window.
# paired: bench_compile's eager tier cpu against keep (PAIRED_ROUNDS rounds, default 2), with this tree and with the tree in .base/
# (a copy of another revision's offloadd/, e.g. `git archive REV offloadd | tar -x -C .base`),
# in the same call: the step-time change of a commit, on the same machine.
#
# Wheels the machine lacks (setuptools >= 77 for the editable install; megatron-core for the
# Megatron client test; kvikio-cu13, libkvikio-cu13 and rapids-logger for the kvikio tests) are
# installed from .whl/ when it holds any. Each part runs under its own time limit and writes its
# log to OUTDIR as it goes, so a part that hangs or runs out of time costs only itself; all parts
# together can outrun one device command (10 minutes), so run them in separate calls there.
# Exits 0 only if every part passed (OUTDIR/rc.txt says which did not).
set -u
out=${1:?usage: scripts/gpu_check.sh OUTDIR [tests] [bench] [floor] [clients]}
shift
parts=${*:-tests compile bench floor clients relay}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PY:-python3}

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    $py -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name())'
    nproc
    df -hT . /tmp
} >"$out/env.txt" 2>&1

{
    if compgen -G ".whl/*.whl" >/dev/null; then
        $py -m pip install -q --no-index --no-deps --no-cache-dir .whl/*.whl
    fi
    $py -m pip install -q --no-deps --no-build-isolation -e . && echo "installed"
    $py -c 'from offloadd.io import native; print("native:", native.available())'
    timeout 60 $py -m offloadd doctor --json >"$out/doctor.json"
    echo "doctor rc=$?"
} >"$out/install.log" 2>&1

pytest_args=(-q -rs -p no:cacheprovider --durations=10 -n 4)
: >"$out/rc.txt"
for part in $parts; do
    echo "$part: start $(date -u +%T)" >>"$out/rc.txt"
    case $part in
    compile)
        timeout 200 $py -m pytest "${pytest_args[@]}" -s tests/runtime/test_compile_cuda.py \
            >"$out/compile_cuda.log" 2>&1
        echo "compile_cuda rc=$?" >>"$out/rc.txt"
        ;;
    tests)
        timeout 150 $py -m pytest "${pytest_args[@]}" tests/runtime/test_cuda.py tests/io/test_gds.py \
            tests/runtime/test_threads_device.py tests/tools/test_doctor.py >"$out/cuda_tests.log" 2>&1
        echo "cuda_tests rc=$?" >>"$out/rc.txt"
        ;;
    bench)
        timeout 200 $py scripts/bench_compile.py --device cuda --tiers keep,cpu,ssd \
            --modes eager,whole --rows 4096 --dim 1024 --steps 6 --rounds 1 \
            --out "$out/bench_compile_cuda.md" >"$out/bench.log" 2>&1
        echo "bench rc=$?" >>"$out/rc.txt"
        ;;
    floor)
        KVIKIO_COMPAT_MODE=ON timeout 90 $py -m pytest "${pytest_args[@]}" tests/io/test_gds.py \
            >"$out/gds_compat.log" 2>&1
        echo "gds_compat rc=$?" >>"$out/rc.txt"
        timeout 60 $py scripts/gpu_floor.py >"$out/floor.json" 2>"$out/floor.log"
        echo "floor rc=$?" >>"$out/rc.txt"
        timeout 120 $py scripts/bench_compile.py --device cuda --tiers keep,cpu --modes eager \
            --rows 4096 --dim 2048 --steps 6 --rounds 1 --out "$out/bench_d2048.md" \
            >"$out/bench_d2048.log" 2>&1
        echo "bench_d2048 rc=$?" >>"$out/rc.txt"
        ;;
    wall | wall-peers)
        what=ours
        [ "$part" = wall-peers ] && what=peers
        timeout 570 $py scripts/wall_gpu.py --out "$out/$part" --strategies $what \
            --memory-limit "${WALL_LIMIT:-40GiB}" ${WALL_ARGS:-} >"$out/$part.log" 2>&1
        echo "$part rc=$?" >>"$out/rc.txt"
        ;;
    clients)
        timeout 150 $py -m pytest "${pytest_args[@]}" tests/integrations/test_clients.py -k megatron \
            >"$out/clients.log" 2>&1
        echo "clients rc=$?" >>"$out/rc.txt"
        ;;
    relay)
        if [ "${RELAY_TESTS:-1}" = 1 ]; then
            timeout 150 $py -m pytest "${pytest_args[@]}" tests/relay/test_relay_cuda.py \
                tests/relay/test_relay.py >"$out/relay_cuda.log" 2>&1
            echo "relay_cuda rc=$?" >>"$out/rc.txt"
        fi
        timeout 150 $py scripts/relay_gpu.py --arms "${RELAY_ARMS:-plain,relay-cpu,relay-ssd,fsdp2-offload}" \
            --out "$out/relay_gpu.json" >"$out/relay_gpu.log" 2>&1
        echo "relay_gpu rc=$?" >>"$out/rc.txt"
        if [ -n "${RELAY_WINDOW:-}" ]; then  # relay-cpu again at another window
            timeout 60 $py scripts/relay_gpu.py --arms relay-cpu --window "$RELAY_WINDOW" \
                --out "$out/relay_gpu_w$RELAY_WINDOW.json" >"$out/relay_gpu_w.log" 2>&1
            echo "relay_gpu_w$RELAY_WINDOW rc=$?" >>"$out/rc.txt"
        fi
        ;;
    paired)
        for f in offloadd/*/*.so; do [ -d .base/offloadd ] && cp "$f" ".base/$f"; done
        for tree in new base; do
            [ $tree = base ] && { [ -d .base/offloadd ] || continue; export PYTHONPATH=$PWD/.base; }
            timeout 150 $py scripts/bench_compile.py --device cuda --tiers keep,cpu --modes eager \
                --rows 4096 --dim 1024 --steps 8 --rounds "${PAIRED_ROUNDS:-2}" --out "$out/paired_$tree.md" \
                >"$out/paired_$tree.log" 2>&1
            echo "paired_$tree rc=$?" >>"$out/rc.txt"
            unset PYTHONPATH
        done
        ;;
    *) echo "unknown part $part" >>"$out/rc.txt" ;;
    esac
done
cat "$out/rc.txt"
! grep -v ": start " "$out/rc.txt" | grep -qv " rc=0$"  # 0 only if every part passed
