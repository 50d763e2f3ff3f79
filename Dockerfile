# tgi-py: CPU image by default; `--build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu126`
# (or another CUDA index) builds the CUDA variant. Every package at constraints.txt's version.
FROM python:3.11-slim

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 \
    TGI_PY_CACHE=/data \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
# a C compiler builds the shard's decode-attention kernel for the host CPU on first start
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
# torch alone from PyTorch's index (the build TORCH_INDEX names); its dependencies, like
# everything else, from PyPI
COPY constraints.txt ./
RUN pip install --no-cache-dir --no-deps -c constraints.txt torch --index-url "${TORCH_INDEX}"
COPY pyproject.toml README.md ./
COPY proto ./proto
COPY router ./router
COPY shard ./shard
COPY launcher ./launcher
RUN pip install --no-cache-dir -c constraints.txt .

VOLUME /data
EXPOSE 8080 50051
ENTRYPOINT ["tgi-launcher"]
CMD ["--hostname", "0.0.0.0", "--port", "8080"]
