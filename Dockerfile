# syntax=docker/dockerfile:1
#
# One image holding every sharegpu component; the command names the component:
#   sharegpu extender | webhook | controller | agent | reserve   (and `sharegpu --help`)
# tests/test_dockerfile.py checks that each component named in the io.sharegpu.components label is a
# command of the CLI, that the base is pinned, and that the image runs as a non-root user.
#
# The base: the Docker official image python:3.11.16-slim-trixie (Debian 13), pinned by tag and by the
# digest of its multi-platform index as docker-library/repo-info records it
# (repos/python/remote/3.11.16-slim-trixie.md), as the default of the build argument BASE, which both
# stages use. Where that image cannot be pulled, scripts/build-image makes a base from Debian's own
# packages (bookworm's python3 and python3-venv: the same Python minor, 3.11) and passes it as BASE:
# the build uses only `python3 -m venv`, which both bases have.
#
# The image runs as uid 65532. The agent's DaemonSet must run it as root instead (runAsUser: 0): it reads
# the kubelet's PodResources socket and the host's /proc, and kills processes that overrun their
# GPU memory (docs/agent.md). NVML (and, for --mps, the MPS control daemon) come from the host's
# driver, mounted by the NVIDIA container toolkit into the containers that are given GPUs: the image
# leaves NVIDIA_DRIVER_CAPABILITIES unset, so they get its default, compute and utility.

ARG BASE=python:3.11.16-slim-trixie@sha256:be1575ed968de893bd54f4c56315ff7c4736ce522c1bca08fd521731aafc0d76

# ---- build: the wheel, with the project's own build backend, then a virtual environment from it ----
FROM ${BASE} AS build

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore

WORKDIR /src
# What the wheel is built from: hatchling (pinned in [build-system]) runs hatch_build.py, which
# generates the protobuf code with grpcio-tools (pinned in [tool.hatch.build.hooks.custom]); the
# manifests, the control-plane build script and its Go modules are packaged as data (force-include in
# pyproject.toml).
COPY pyproject.toml hatch_build.py README.md ./
COPY src ./src
COPY deploy ./deploy
COPY scripts/build-controlplane scripts/build-runtime scripts/build-kueue scripts/build-prometheus ./scripts/
COPY controlplane ./controlplane
# The build's own pip lives in a virtual environment of its own (a Debian base has no pip outside one).
RUN python3 -m venv /opt/build \
    && /opt/build/bin/pip wheel --no-deps --wheel-dir /dist .

# The runtime environment: the wheel and its pinned runtime dependencies only (no [dev] extra, no pip).
RUN python3 -m venv --without-pip /opt/sharegpu \
    && /opt/build/bin/pip --python /opt/sharegpu/bin/python install /dist/sharegpu-*.whl \
    && /opt/sharegpu/bin/sharegpu --version

# ---- runtime: the base image, the environment, an unprivileged user ----
FROM ${BASE}

LABEL org.opencontainers.image.title="sharegpu" \
      org.opencontainers.image.description="Share NVIDIA GPUs between Kubernetes pods: the scheduler extender, admission webhook, controller, node agent and reservation holder in one image." \
      org.opencontainers.image.licenses="Apache-2.0" \
      io.sharegpu.components="extender webhook controller agent reserve"

RUN groupadd --system --gid 65532 sharegpu \
    && useradd --system --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin sharegpu

COPY --from=build /opt/sharegpu /opt/sharegpu

ENV PATH=/opt/sharegpu/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1

# The components' default ports: webhook 8443, extender 8888 (kube-scheduler) and 8889 (health,
# metrics), controller 8890, agent 9403.
EXPOSE 8443 8888 8889 8890 9403

USER 65532:65532
ENTRYPOINT ["sharegpu"]
CMD ["--help"]
