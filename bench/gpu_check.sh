#!/usr/bin/env bash
# Every GPU claim of the project, checked in one call on a GPU machine that cannot reach the network.
#
#   bash bench/gpu_check.sh prepare [SHARED]   here (with network): fill .gpu/ with what the GPU machine lacks,
#                                              wheels for Python 3.12 and the shared data and baseline scripts
#   bash bench/gpu_check.sh run                there, from the project root, with .gpu/ carried; results to $OUT
#
# `run` installs the wheels over the machine's own torch, then writes to $OUT (or bench/out/gpu):
#   tests.log        the GPU tests and the nccl tests (tests/test_gpu.py, tests/test_distributed.py)
#   vs_tutorials.log the job against seed_iris.py and seed_cifar.py on cuda (10 CIFAR-10 epochs, accuracy too)
#   bench.log        `python -m job bench` for the Iris and CIFAR-10 presets, cpu and cuda
#   info.txt         `python -m job info`
# Each part runs even when one before it failed; the exit code is the first failure's.
set -u
cd "$(dirname "$0")/.."
G=.gpu
case "${1:-}" in
prepare)
    shared=${2:-../shared}
    mkdir -p "$G/wheels" "$G/shared"
    # Everything but torch, torchvision and their own dependencies, which the GPU machine has.
    grep -v -E '^(torch|torchvision)' requirements.txt | grep -v '^#' >"$G/requirements.txt"
    echo pytest >>"$G/requirements.txt"
    python3 -m pip download -q -d "$G/wheels" --only-binary=:all: --python-version 3.12 \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
        -r "$G/requirements.txt"
    # The machine has these with its torch, torchvision and TensorBoard; a carry holds 64 MiB in all.
    rm -f "$G"/wheels/numpy-*.whl "$G"/wheels/pillow-*.whl "$G"/wheels/grpcio-*.whl "$G"/wheels/tensorboard-*.whl
    cp -r "$shared/baselines" "$shared/datasets" "$G/shared/"
    cp "$shared/acceptance/lib/cifar_fixture.py" "$G/"
    du -sh "$G"
    ;;
run)
    out=${OUT:-bench/out/gpu}
    mkdir -p "$out"
    rc=0
    note() { [ "$1" = 0 ] || { [ "$rc" = 0 ] && rc=$1; }; }
    python3 -m pip install -q --no-index --find-links "$G/wheels" -r "$G/requirements.txt" >"$out/install.log" 2>&1
    note $?
    python3 -m job info >"$out/info.txt" 2>&1
    note $?
    timeout 900 python3 -m pytest -q -rs tests/test_gpu.py tests/test_distributed.py >"$out/tests.log" 2>&1
    note $?
    python3 "$G/shared/baselines/prep_cifar.py" "$G/shared/datasets/cifar10-jpeg.tar.gz" /tmp/gpu-cifar-pt \
        >"$out/prep.log" 2>&1
    note $?
    root=$(python3 "$G/cifar_fixture.py" "$G/shared" 50000 2>>"$out/prep.log")
    note $?
    python3 bench/vs_tutorials.py --device cuda --baselines "$G/shared/baselines" --repeats 2 --cifar-epochs 10 \
        --cifar-python "$root/python-50000/cifar-10-batches-py" --cifar-pt /tmp/gpu-cifar-pt >"$out/vs_tutorials.log" 2>&1
    note $?
    {
        python3 -m job bench --config iris --devices cpu,cuda
        python3 -m job bench --config cifar10 --devices cuda --epochs 3 \
            --set "data.path=$root/python-50000/cifar-10-batches-py"
    } >"$out/bench.log" 2>&1
    note $?
    tail -n 3 "$out"/*.log
    exit "$rc"
    ;;
*)
    sed -n '2,13p' "$0"
    exit 2
    ;;
esac
