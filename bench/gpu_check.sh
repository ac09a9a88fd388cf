#!/usr/bin/env bash
# Every GPU claim of the project, checked on a GPU machine that cannot reach the network, in calls of under
# 600 s each.
#
#   bash bench/gpu_check.sh prepare [SHARED]   here (with network): fill .gpu/ with what the GPU machine lacks,
#                                              wheels for Python 3.12 and the shared data and baseline scripts
#   bash bench/gpu_check.sh tests              there, from the project root, with .gpu/ carried: the GPU tests and
#                                              the nccl tests (tests.log), `python -m job info` (info.txt)
#   bash bench/gpu_check.sh bench              there: the job against seed_iris.py and seed_cifar.py on cuda, 10
#                                              CIFAR-10 epochs with accuracy (vs_tutorials.log, REPEATS=2 times);
#                                              ideal_cifar.py fp32 and graph (ideal.log); `python -m job bench`,
#                                              Iris on cpu and cuda, CIFAR-10 on cuda (bench.log)
#   bash bench/gpu_check.sh fast               there: the cifar10-fast preset against airbench94, 3 runs each
#                                              (vs_airbench.log)
#   bash bench/gpu_check.sh stream             there: ResNet-50 on 20,000 photos streamed from JPEG shards
#                                              (decoded on the host, and on the GPU) against pre-decoded on the
#                                              GPU (stream_gpu.log)
#   bash bench/gpu_check.sh predict            there: `job predict` on 2,000 photos with ResNet-50, decoded on the
#                                              host and on the GPU, against the model's forward pass on pre-decoded
#                                              tensors on the GPU (predict_gpu.log)
#   bash bench/gpu_check.sh all [SECONDS] [PART=S...]  there: tests, fast, bench, stream, predict in that order in
#                                              one call, each command's time limit cut to what is left of SECONDS
#                                              (default 570) and to its part's S if given (tests=150 fast=120 ...),
#                                              a command with under 30 s left not started (noted in skipped.txt)
#
# Results go to $OUT (or bench/out/gpu). Each part runs even when one before it failed; the exit code is the
# first failure's. TESTS_K: the tests' -k expression; REPEATS: vs_tutorials.py's; IDEAL: the ideal_cifar.py variants
# ("" for none); STREAM_IMAGES: stream_gpu.py's --images.
#
# What the parts took on one H100 (16 cores), 2026-11-27, with the image's torch 2.11:
# - install 20 s (the wheels and the image's packages do not resolve together, so the wheels of packages it lacks go
#   in alone);
# - tests over 120 s with 4 processes (35 of them run by then);
# - fast 45 s per pair of runs (airbench's process 19.4-23.6 s, the job's 14.6-17.2 s);
# - bench over 125 s with REPEATS=1 (seed_cifar.py's 10 epochs alone are about 65 s); ideal_cifar.py 20-30 s a
#   variant;
# - stream 32 s to make and pack 20,000 photos, then over 75 s of training;
# - predict 58 s to make photos and train, then over 25 s.
# One 600 s call holds tests, fast and bench, or stream and predict, not all.
# With 15 minutes of device time, two calls on one warm machine (it waits 30 s after a call: start the second at
# once): `REPEATS=1 IDEAL=graph bash bench/gpu_check.sh all 560 tests=170 fast=150 bench=225`, then
# `PARTS="stream predict" STREAM_IMAGES=10000 bash bench/gpu_check.sh all 250 stream=130`. PARTS: the parts `all`
# runs, in its order.
set -u
cd "$(dirname "$0")/.."
G="$PWD/.gpu"  # absolute: the benchmarks run their baselines from folders of their own
export PYTHONUNBUFFERED=1
out=${OUT:-bench/out/gpu}
mkdir -p "$out"
rc=0
note() { [ "$1" = 0 ] || [ "$rc" != 0 ] || rc=$1; }
end=$((SECONDS + 100000))
part_end=$end
# A command's time limit: its own, or what is left before the end (all) or its part's end, less a margin for the logs.
limit() {
    local stop=$end
    [ "$part_end" -lt "$stop" ] && stop=$part_end
    local left=$((stop - SECONDS - 15))
    if [ "$left" -lt "$1" ]; then echo "$left"; else echo "$1"; fi
}
# run LIMIT LOG COMMAND...: the command under its limit, its output to LOG; not started with under 30 s left.
run() {
    local t
    t=$(limit "$1")
    if [ "$t" -lt 30 ]; then
        echo "$(basename "$2"): not started, ${t} s left" >>"$out/skipped.txt"
        return
    fi
    # SIGINT first, to the command's whole process group: a script then writes its traceback.
    timeout -s INT -k 20 "$t" "${@:3}" >>"$2" 2>&1
    note $?
}
install() {
    [ -n "${installed:-}" ] && return
    installed=1
    mkdir -p "$out"
    # The image's own packages stay: where they and the wheels cannot be resolved together (its tensorboard's grpcio
    # against google-api-core's, say), the wheels of packages it lacks go in alone.
    python3 -m pip install -q --no-index --find-links "$G/wheels" -r "$G/requirements.txt" >>"$out/install.log" 2>&1 ||
        python3 - "$G/wheels" >>"$out/install.log" 2>&1 <<'PY'
import subprocess, sys
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

def present(name):
    try:
        distribution(name)
        return True
    except PackageNotFoundError:
        return False

lacking = [str(w) for w in sorted(Path(sys.argv[1]).glob("*.whl")) if not present(w.name.split("-")[0])]
print("installing without resolving:", " ".join(Path(w).name for w in lacking), flush=True)
sys.exit(subprocess.call([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", *lacking]))
PY
    python3 -c "import job.config, job.run.train, job.recipe.build, job.cli" >>"$out/install.log" 2>&1
    note $?
}
tests() {
    install
    python3 -m job info >"$out/info.txt" 2>&1
    note $?
    # Whether the machine can run the CUDA image (item 3 of the GPU issue): a container engine, or none.
    { command -v docker podman nvidia-container-cli || echo "no container engine"; } >>"$out/info.txt" 2>&1
    # Four test processes share the GPU where pytest-xdist is installed: most of a test's time is a job's start-up.
    local workers=()
    python3 -c "import xdist" 2>/dev/null && workers=(-n 4)
    # -v: each test's result is written as it ends, so a run cut at its limit still names what failed (the group's
    # SIGINT reaches xdist's workers too, and the summary at the end may not be written).
    run 500 "$out/tests.log" python3 -m pytest -v -rfEs --tb=short -p no:benchmark --durations=25 "${workers[@]}" \
        tests/test_gpu.py tests/test_distributed.py -k "${TESTS_K:-gpu or cuda or nccl}"
    grep -E "(FAILED|ERROR) " "$out/tests.log"
    tail -n 2 "$out/tests.log"
}
cifar_data() {
    [ -f /tmp/gpu-cifar-pt/test.pt ] || python3 "$G/shared/baselines/prep_cifar.py" \
        "$G/shared/datasets/cifar10-jpeg.tar.gz" /tmp/gpu-cifar-pt >"$out/prep.log" 2>&1
    note $?
    root=$(python3 "$G/cifar_fixture.py" "$G/shared" 50000 2>>"$out/prep.log")
    note $?
    cifar="$root/python-50000/cifar-10-batches-py"
}
fast() {
    install
    cifar_data
    run 500 "$out/vs_airbench.log" python3 bench/vs_airbench.py --baselines "$G/shared/baselines" \
        --airbench "$G/airbench-0.1.8" --cifar-python "$cifar" --cifar-pt /tmp/gpu-cifar-pt --runs 3
    tail -n 12 "$out/vs_airbench.log"
}
bench() {
    install
    cifar_data
    run 300 "$out/vs_tutorials.log" python3 bench/vs_tutorials.py --device cuda --baselines "$G/shared/baselines" \
        --repeats "${REPEATS:-2}" --cifar-epochs 10 --cifar-python "$cifar" --cifar-pt /tmp/gpu-cifar-pt
    # The same recipe done fast by hand (data resident on the GPU): eager fp32 and one CUDA graph per step.
    for v in ${IDEAL-fp32 graph}; do
        run 60 "$out/ideal.log" python3 "$G/shared/baselines/ideal_cifar.py" /tmp/gpu-cifar-pt 10 "$v"
    done
    run 120 "$out/bench.log" python3 -m job bench --config iris --devices cpu,cuda
    run 100 "$out/bench.log" python3 -m job bench --config cifar10 --devices cuda --epochs 3 --set "data.path=$cifar"
    tail -n 12 "$out/vs_tutorials.log" "$out/ideal.log" "$out/bench.log"
}
stream() {
    install
    run 560 "$out/stream_gpu.log" python3 bench/stream_gpu.py "$G/shared/datasets/cifar10-jpeg.tar.gz" \
        --images "${STREAM_IMAGES:-20000}"
    tail -n 8 "$out/stream_gpu.log"
}
predict() {
    install
    run 500 "$out/predict_gpu.log" python3 bench/predict_gpu.py "$G/shared/datasets/cifar10-jpeg.tar.gz"
    tail -n 6 "$out/predict_gpu.log"
}
case "${1:-}" in
prepare)
    set -e
    shared=${2:-../shared}
    mkdir -p "$G/wheels" "$G/shared"
    # Everything but torch and torchvision, which the GPU machine has with their own dependencies.
    grep -v -E '^(torch|torchvision|#)' requirements.txt >"$G/requirements.txt"
    echo pytest >>"$G/requirements.txt"
    platforms=()
    for tag in manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28 manylinux_2_31 manylinux_2_34; do
        platforms+=(--platform "${tag}_x86_64")
    done
    python3 -m pip download -q -d "$G/wheels" --only-binary=:all: --python-version 3.12 "${platforms[@]}" \
        -r "$G/requirements.txt"
    # The machine has these with its torch, torchvision and TensorBoard; a carry holds 64 MiB in all.
    rm -f "$G"/wheels/numpy-*.whl "$G"/wheels/pillow-*.whl "$G"/wheels/grpcio-*.whl "$G"/wheels/tensorboard-*.whl \
        "$G"/wheels/tensorboard_data_server-*.whl "$G"/wheels/pyarrow-*.whl
    cp -r "$shared/baselines" "$shared/datasets" "$G/shared/"
    cp "$shared/acceptance/lib/cifar_fixture.py" "$G/"
    # airbench94, the record the cifar10-fast preset is measured against: its source, read from its folder.
    python3 -m pip download -q -d "$G/sdist" --no-deps --no-binary=:all: airbench==0.1.8
    tar xzf "$G"/sdist/airbench-0.1.8.tar.gz -C "$G" && rm -rf "$G/sdist"
    du -sh "$G"
    ;;
tests | fast | bench | stream | predict)
    "$1"
    exit "$rc"
    ;;
all)
    end=$((SECONDS + ${2:-570}))
    declare -A cap=()
    for a in "${@:3}"; do cap[${a%%=*}]=${a#*=}; done
    # CIFAR-10's files for fast and bench are made on the CPU while the tests run.
    install
    parts=${PARTS:-tests fast bench stream predict}
    prep=
    case " $parts " in *" fast "* | *" bench "*) cifar_data & prep=$! ;; esac
    for part in $parts; do
        case $part in fast | bench) [ -n "$prep" ] && wait "$prep" ;; esac
        part_end=$((SECONDS + ${cap[$part]:-100000}))
        echo "== $part ($((end - SECONDS)) s left)"
        if [ "$(limit 100000)" -lt 30 ]; then
            echo "$part: not started, $((end - SECONDS)) s left" >>"$out/skipped.txt"
            continue
        fi
        "$part"
    done
    exit "$rc"
    ;;
*)
    sed -n '2,25p' "$0"
    exit 2
    ;;
esac
