# syntax=docker/dockerfile:1
# Motor's image: the `motor` command (Controller, Coordinator, NodeManager, simulated engine) in
# a virtual environment, run as an unprivileged user. docs/kubernetes.md says how to build it.
#
#   docker build -t motor-mesh:0.1.0 -t motor-mesh-engine:0.1.0 .
#   docker build --build-arg ENGINE_PACKAGES=vllm -t motor-mesh-engine:0.1.0 .
#
# ENGINE_PACKAGES: pip requirements of the engines a NodeManager launches (vllm, sglang[all]),
# resolved together with Motor's own so neither breaks the other. Empty: the simulated engine only.

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS builder
ARG ENGINE_PACKAGES=""
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/motor
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY gen ./gen
COPY services ./services
RUN /opt/motor/bin/pip wheel --no-deps --wheel-dir /wheels . \
 && /opt/motor/bin/pip install /wheels/*.whl ${ENGINE_PACKAGES} \
 && /opt/motor/bin/pip check

FROM ${PYTHON_IMAGE}
# The uid and gid the Kubernetes manifests run as (securityContext.runAsUser, runAsGroup,
# fsGroup in deploy/k8s): change both together.
RUN groupadd --system --gid 10001 motor \
 && useradd --system --uid 10001 --gid 10001 --home-dir /home/motor --create-home \
    --shell /usr/sbin/nologin motor
COPY --from=builder /opt/motor /opt/motor
# Bytecode was compiled at install time; the root filesystem is read-only in a pod.
ENV PATH=/opt/motor/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/home/motor
WORKDIR /home/motor
USER 10001:10001
ENTRYPOINT ["motor"]
CMD ["--help"]
