# Images of the training job, one per target (docs/containers.md):
#   docker build --target cpu  -t job:cpu  .   python:3.11-slim + torch's CPU-only build
#   docker build --target cuda -t job:cuda .   python:3.11-slim + torch's CUDA 13.0 build, whose wheels bring the CUDA
#                                              and cuDNN libraries (the driver comes from the host, mounted by
#                                              NVIDIA's container toolkit)
# Bases and package sources are build args with public defaults, so a build can use a mirror or local wheels.
# Nothing secret belongs in a build arg (they are kept in the image's history): credentials are mounted when the
# container runs. Both targets share one stage and differ only in torch's build and the NVIDIA_* variables.
#
# In the image: the job runs as the unprivileged user `job` (uid 1000) under tini, which forwards SIGTERM (a
# `docker stop`, a preempted VM) to it, so it commits a checkpoint and exits 75; `tini -s` also works under
# Docker's own init (Compose's `init: true`, `docker run --init`). The working directory is /, so
# the job's default run folder, runs/<name>, is /runs/<name>: mount the runs volume there. Caches go to /cache
# (the job's remote inputs and the staging of remote outputs: a volume, to keep them across restarts).
# No HEALTHCHECK: a batch job's health is its exit code.

ARG BASE=python:3.11-slim

FROM ${BASE} AS base
# Versions are whatever the base's distribution ships: the base tag pins them.
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 1000 --user-group job \
    && mkdir -p /runs /cache \
    && chmod 1777 /runs /cache \
    && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONPATH=/app \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    JOB_CACHE_DIR=/cache \
    XDG_CACHE_HOME=/tmp/.cache
WORKDIR /
ENTRYPOINT ["tini", "-s", "--", "python", "-m", "job"]
CMD ["train"]
COPY requirements.txt /tmp/requirements.txt
# What a run never uses leaves the image once installed (docker/slim.sh says what and why).
COPY docker/slim.sh /tmp/slim.sh

FROM base AS cpu
ARG PIP_INDEX_URL=https://pypi.org/simple
ARG PIP_EXTRA_INDEX_URL=
ARG PIP_TRUSTED_HOST=
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.14.1
ARG TORCHVISION_VERSION=0.29.1
# Dependencies before the code, so a code change rebuilds one small layer. torch and torchvision come first from
# TORCH_INDEX_URL (the build of torch it holds wins), the rest from PIP_INDEX_URL; pip reads the PIP_* args.
RUN everything_else="$PIP_INDEX_URL $PIP_EXTRA_INDEX_URL" \
    && PIP_INDEX_URL="$TORCH_INDEX_URL" PIP_EXTRA_INDEX_URL="$everything_else" \
        pip install --no-cache-dir "torch==${TORCH_VERSION}" "torchvision==${TORCHVISION_VERSION}" \
    && pip install --no-cache-dir -r /tmp/requirements.txt \
    && sh /tmp/slim.sh
COPY job/ /app/job/
USER 1000:1000

FROM base AS cuda
# NVIDIA's container toolkit mounts the host's driver into a container that asks for these capabilities; torch's
# wheels (the nvidia-* packages) bring every other CUDA library, so the base needs none of its own.
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
ARG PIP_INDEX_URL=https://pypi.org/simple
ARG PIP_EXTRA_INDEX_URL=
ARG PIP_TRUSTED_HOST=
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
ARG TORCH_VERSION=2.14.1
ARG TORCHVISION_VERSION=0.29.1
RUN everything_else="$PIP_INDEX_URL $PIP_EXTRA_INDEX_URL" \
    && PIP_INDEX_URL="$TORCH_INDEX_URL" PIP_EXTRA_INDEX_URL="$everything_else" \
        pip install --no-cache-dir "torch==${TORCH_VERSION}" "torchvision==${TORCHVISION_VERSION}" \
    && pip install --no-cache-dir -r /tmp/requirements.txt \
    && sh /tmp/slim.sh
COPY job/ /app/job/
USER 1000:1000
