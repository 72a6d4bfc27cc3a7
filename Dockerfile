# kvpool GPU image: one `kvpool serve` process per GPU (the pool lives in that process: one worker).
#   docker build -t kvpool:0.1.0 .
#   docker run --gpus '"device=0"' --ipc=host -p 8000:8000 kvpool:0.1.0
# --ipc=host lets frontends in other containers on the host open the pool through CUDA IPC.
#
# The CUDA *base* flavour is enough: torch's CUDA 13 wheels carry their own CUDA libraries; the image
# contributes the NVIDIA container settings. Needs an NVIDIA driver >= 580 (CUDA 13) on the host.
FROM nvidia/cuda:13.0.2-base-ubuntu24.04

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# Python 3.12, plus gcc and the Python headers: Triton compiles its kernel launchers at run time. OpenSSL's
# headers: the core's prefix index calls its SHA-256 (the library hashlib wraps).
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        gcc=4:13.2.* \
        libc6-dev=2.39-* \
        libssl-dev=3.0.13-* \
        python3.12=3.12.3-* \
        python3.12-dev=3.12.3-* \
        python3.12-venv=3.12.3-* \
    && rm -rf /var/lib/apt/lists/* \
    && python3.12 -m venv /opt/venv

# Dependencies in their own layer: rebuilt only when the pinned list changes, not on every source edit.
COPY deploy/requirements.txt /tmp/requirements.txt
# The list is the whole closure, so --no-deps installs exactly it; pip check proves nothing is missing.
RUN pip install --no-cache-dir --no-deps -r /tmp/requirements.txt && pip check

WORKDIR /opt/kvpool
COPY pyproject.toml setup.py README.md ./
COPY service ./service
COPY kernels ./kernels
# No build isolation: setuptools (and Cython) come from the pinned list instead of unpinned downloads. The
# gcc and Python headers installed above compile the extensions setup.py builds (the core's loops).
RUN pip install --no-cache-dir --no-deps --no-build-isolation . \
    && useradd --system --uid 10001 --user-group --create-home --home-dir /home/kvpool kvpool

USER 10001:10001
ENV KVPOOL_DEVICE=cuda \
    TRITON_CACHE_DIR=/home/kvpool/.triton/cache
EXPOSE 8000
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=15s --timeout=3s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=2)"]
ENTRYPOINT ["kvpool"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
