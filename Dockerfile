# qlora for CUDA GPU boxes.
#   docker build -t qlora .
#   docker run --gpus all -v $PWD:/data -v qlora-cache:/cache qlora train /data/config.yaml
# Gated or private hub repos: pass your token at run time with -e HF_TOKEN; none is stored in the image.
# The tag pins PyTorch 2.13 on CUDA 13.0 (NVIDIA driver 580 or newer); for an older driver build with
# --build-arg BASE_IMAGE=pytorch/pytorch:2.13.0-cuda12.6-cudnn9-runtime
ARG BASE_IMAGE=pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime
FROM ${BASE_IMAGE}

# Triton builds each kernel's launcher with the host C compiler at run time; the distribution's
# current gcc is the one that matches its libc headers, so it is not pinned.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/qlora
COPY pyproject.toml README.md ./
COPY qlora_cli/ qlora_cli/
COPY kernels/ kernels/
COPY configs/ configs/
RUN python -m pip install --no-cache-dir .

# Runs as uid 1000 (newer Ubuntu bases already have that user), so what it writes into a bind-mounted
# folder belongs to the usual first user of a Linux host; the cache is writable by any uid, so
# `--user "$(id -u):$(id -g)"` works too.
RUN (id -u 1000 >/dev/null 2>&1 || useradd --create-home --uid 1000 --user-group qlora) \
    && mkdir -p /cache/huggingface /cache/triton /data \
    && chown 1000:1000 /data \
    && chmod 1777 /cache /cache/huggingface /cache/triton

ENV HF_HOME=/cache/huggingface \
    TRITON_CACHE_DIR=/cache/triton \
    PYTHONUNBUFFERED=1
VOLUME /cache
USER 1000:1000
WORKDIR /data
ENTRYPOINT ["qlora"]
CMD ["--help"]
