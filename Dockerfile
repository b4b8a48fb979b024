# The one image every pagefleet component runs: `pagefleet operator`, `pagefleet gateway` and
# `pagefleet daemon` (the chart's operator Deployment and every InferenceService's pods).
#
#   docker build -t ghcr.io/pagefleet/pagefleet:0.1.0 .                                   # CPU
#   docker build --build-arg TORCH_VARIANT=cu124 -t ghcr.io/pagefleet/pagefleet:0.1.0-cuda .
#
# TORCH_VARIANT picks the PyTorch wheel index (cpu, cu124, cu126, ...): the CUDA wheels carry
# their CUDA runtime, so the base stays python-slim and only the host needs the NVIDIA driver.
# The install line is the one CI runs (Makefile `setup`); tests/test_dockerfile.py keeps the
# two equal, so the image holds exactly the dependency set the test suite passed with.
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim-bookworm

ARG TORCH_VARIANT=cpu
ENV PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/${TORCH_VARIANT} \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/home/pagefleet \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# g++ builds the compiled CPU attention kernel on a daemon's first start (for that node's
# CPU, cached under $PAGEFLEET_CACHE); without it a CPU daemon falls back to torch attention.
RUN apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends g++ >/dev/null \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/pagefleet
COPY pyproject.toml README.md ./
COPY pagefleet ./pagefleet
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install --disable-pip-version-check -q --upgrade pip \
 && /opt/venv/bin/pip install --disable-pip-version-check -q -e '.[dev]' \
 && useradd --uid 65532 --home-dir /home/pagefleet --create-home pagefleet

# The chart runs every container as this non-root user (runAsUser 65532).
USER 65532
ENTRYPOINT ["pagefleet"]
CMD ["--help"]
