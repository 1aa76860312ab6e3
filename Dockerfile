# tokenloom: one image for the API (`tokenloom serve`), the workers (`tokenloom worker`) and the
# migration step (`tokenloom db upgrade`); docker-compose.yml runs them.
#
#   docker build -t tokenloom .                            # CUDA 12.8 torch (runs on CPU too)
#   docker build -t tokenloom --build-arg TORCH_VARIANT=cpu .  # CPU-only torch, ~2 GB smaller
FROM python:3.11-slim

# Which PyTorch wheel index to install torch from: cpu, or a CUDA build such as cu128 / cu126.
# Installed first and on its own, so the project's dependencies never pull a different torch.
ARG TORCH_VARIANT=cu128
ARG TORCH_SPEC="torch>=2.5"

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/models/huggingface \
    XDG_CACHE_HOME=/models/cache

# g++ builds tokenloom's C++ CPU kernels (engine/csrc) the first time a CPU worker starts; the
# build is cached on the /models volume (TORCH_EXTENSIONS_DIR), so later starts load it at once.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
ENV TORCH_EXTENSIONS_DIR=/models/torch_extensions

RUN pip install --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}" "${TORCH_SPEC}"

WORKDIR /app
# Editable install: `tokenloom db upgrade` finds migrations/ next to the worker package, and the
# working directory's config.toml is the default configuration (TOKENLOOM_* env vars override it).
COPY pyproject.toml README.md LICENSE config.toml ./
COPY engine engine
COPY worker worker
COPY api api
COPY migrations migrations
RUN pip install -e .

RUN useradd --create-home --uid 1000 tokenloom && mkdir -p /models && chown tokenloom /models
USER tokenloom
VOLUME /models
EXPOSE 8000
CMD ["tokenloom", "serve", "--host", "0.0.0.0"]
