#!/usr/bin/env bash
# Regenerates the Python stubs of proto/generate.proto (the shard contract), proto/model_host.proto
# (the launcher contract) and proto/api.proto (the public gRPC API) (run from anywhere).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. \
  proto/generate.proto proto/api.proto proto/model_host.proto
