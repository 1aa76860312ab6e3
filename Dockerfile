# tokenloom: one image for the API (`tokenloom serve`), the workers (`tokenloom worker`) and the
# migration step (`tokenloom db upgrade`); docker-compose.yml runs them.
#
#   docker build -t tokenloom:cuda .                               # CUDA torch (runs on CPU too)
#   docker build -t tokenloom:cpu --build-arg TORCH_VARIANT=cpu .   # CPU-only torch, ~2 GB smaller
# Tag each variant apart (compose does: tokenloom:cpu, tokenloom:cuda), so a CPU build never
# stands in for the GPU worker's image.

# Which locked dependency set to install: requirements/cuda.lock (PyPI's CUDA torch) or
# requirements/cpu.lock (the CPU torch from PyTorch's CPU index). The lock is used as constraints:
# the image gets the runtime dependencies at exactly the versions CI tested, not the test tools.
# Each variant installs in its own stage (install-cpu, install-cuda) and the image continues from
# the chosen one; BuildKit (docker's default builder) skips the other.
ARG TORCH_VARIANT=cuda

FROM python:3.11-slim AS base

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/models/huggingface \
    XDG_CACHE_HOME=/models/cache

# g++ builds tokenloom's C++ CPU kernels; they are built below, at image build time. A host whose
# CPU differs from the build machine's rebuilds them once at the first start, into the /models volume.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
ENV TORCH_EXTENSIONS_DIR=/opt/tokenloom/kernels

WORKDIR /app
COPY requirements requirements
COPY pyproject.toml README.md LICENSE config.toml ./
COPY engine engine
COPY openai_protocol openai_protocol
COPY offline offline
COPY settings settings
COPY store store
COPY worker worker
COPY api api
COPY cli cli
COPY migrations migrations

# Each install stage: a regular install of the tokenloom.* packages (migrations included as package
# data); the working directory's config.toml is the default configuration (TOKENLOOM_* env vars
# override it). Only the CPU variant sees PyTorch's CPU index: seen by a CUDA install, its
# `torch==2.13.0+cpu` satisfies cuda.lock's `torch==2.13.0` and wins over PyPI's CUDA wheel (a
# local version label sorts higher), and the GPU image would silently get CPU torch.
# TORCH_CPU_INDEX: where the CPU torch wheel comes from; PyTorch's CPU index unless a machine that
# cannot reach it passes a copy (the compose test does: tests/compose/torch_wheel_index.py).
# Declared in this stage only, so no other stage can see it.
FROM base AS install-cpu
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install --extra-index-url ${TORCH_CPU_INDEX} -c requirements/cpu.lock ".[all]"

# PyPI alone, and the build fails unless that gave a torch built with CUDA.
FROM base AS install-cuda
RUN pip install -c requirements/cuda.lock ".[all]" \
    && python -c "import sys, torch; torch.version.cuda or sys.exit( \
        'torch ' + torch.__version__ + ' has no CUDA (torch.version.cuda is None): the cuda image must ' \
        'install PyPI torch, with no CPU wheel index (PIP_EXTRA_INDEX_URL, PIP_FIND_LINKS, pip.conf) in sight')"

FROM install-${TORCH_VARIANT}
RUN tokenloom build-kernels

# The mount points of compose's volumes exist here, owned by the user, so a fresh named volume
# (the Hugging Face cache) starts writable by it.
RUN useradd --create-home --uid 1000 tokenloom && mkdir -p /models/huggingface /models/local \
    && chown -R tokenloom /models /opt/tokenloom
USER tokenloom
VOLUME /models
EXPOSE 8000
CMD ["tokenloom", "serve", "--host", "0.0.0.0"]
