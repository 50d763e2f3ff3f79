#!/usr/bin/env bash
# Fetches into .whl/ the Python packages the lent GPU machines' image lacks, or holds in versions
# our generated stubs refuse (protobuf, grpcio), at this checkout's installed versions, for a
# device run to carry (`carry: [".whl"]`; benchmarks/gpu_check.sh installs them). The image's
# own PyTorch (CUDA), transformers, tokenizers, aiohttp and pytest are used as they are.
set -euo pipefail
cd "$(dirname "$0")/.."
exclude="$(git rev-parse --git-common-dir)/info/exclude"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
python=${PYTHON:-.venv/bin/python}
packages=(protobuf grpcio grpcio-health-checking grpcio-reflection llguidance gguf orjson
          opentelemetry-api opentelemetry-sdk opentelemetry-proto
          opentelemetry-semantic-conventions opentelemetry-exporter-otlp-common
          opentelemetry-exporter-otlp-proto-common opentelemetry-exporter-otlp-proto-grpc
          googleapis-common-protos pytest-asyncio python-json-logger python-dotenv swagger-ui-bundle)
pinned=()
for name in "${packages[@]}"; do
    version=$("$python" -m pip show "$name" | sed -n 's/^Version: //p')
    pinned+=("$name==$version")
done
platforms=()
for tag in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 \
           manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
    platforms+=(--platform "${tag}_x86_64")
done
rm -rf .whl
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d .whl "${pinned[@]}"
du -sh .whl
