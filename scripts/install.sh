#!/usr/bin/env bash
# Creates .venv and installs tgi-py with its test tools; does nothing when pyproject.toml is unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=".venv/.tgi-py-installed"
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  # torch is pinned to 2.13.0, the CPU build; install it first so nothing pulls a CUDA build
  .venv/bin/pip install --quiet --disable-pip-version-check torch==2.13.0
  .venv/bin/pip install --quiet --disable-pip-version-check -e '.[test]'
  # TGI's own Python client, for the compatibility tests. Its metadata asks for huggingface-hub<1.0,
  # which transformers 5 cannot use; it only imports build_hf_headers, which hub 1.x still has.
  .venv/bin/pip install --quiet --disable-pip-version-check --no-deps text-generation==0.7.0
  echo "$want" > "$stamp"
fi
