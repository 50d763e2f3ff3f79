#!/usr/bin/env bash
# Creates .venv and installs tgi-py with its test tools at constraints.txt's versions: PyTorch's CPU
# build on a machine without an NVIDIA GPU, its CUDA build on one with. Does nothing when
# pyproject.toml, constraints.txt, this script and the torch choice are those of the last install.
#   TGI_PY_TORCH=cpu|cuda      the build to install, instead of the one `nvidia-smi -L` implies
#   TGI_PY_TORCH_INDEX=URL     the index torch comes from, e.g. PyTorch's CUDA 12.6 index at
#                              https://download.pytorch.org/whl/cu126 (by default PyTorch's CPU
#                              index for cpu, the default index for cuda: PyPI's Linux wheels are
#                              CUDA builds); one that does not answer within seconds gives way to
#                              the default index
#   TGI_PY_INSTALL_DRY_RUN=1   prints the choice and the pip command for torch; installs nothing
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
PIP=(.venv/bin/pip install --quiet --disable-pip-version-check)
CPU_INDEX=https://download.pytorch.org/whl/cpu
PROBE_TIMEOUT_S=5

say() { echo "install.sh: $*"; }

# sets build (cpu|cuda) and why
choose_build() {
  local listed gpu
  case "${TGI_PY_TORCH:-}" in
    cpu|cuda) build="$TGI_PY_TORCH"; why="TGI_PY_TORCH=$TGI_PY_TORCH" ;;
    "")
      if listed="$(nvidia-smi -L 2>/dev/null)" && gpu="$(grep -m1 '^GPU ' <<<"$listed")"; then
        build=cuda; why="nvidia-smi -L lists ${gpu%% (UUID*}"
      else
        build=cpu; why="no NVIDIA GPU: nvidia-smi -L lists none"
      fi ;;
    *) echo "install.sh: TGI_PY_TORCH is cpu or cuda, not '$TGI_PY_TORCH'" >&2; exit 2 ;;
  esac
}

# whether an index answers for torch within seconds (pip itself would retry for minutes); the
# page's headers are enough, its body is not read
reachable() {
  "$PYTHON" - "$1/torch/" "$PROBE_TIMEOUT_S" <<'EOF' 2>/dev/null
import sys, urllib.request
urllib.request.urlopen(sys.argv[1], timeout=float(sys.argv[2])).close()
EOF
}

# sets index_args and where: PyTorch's index for the chosen build, or the default index
choose_index() {
  local index="${TGI_PY_TORCH_INDEX:-}"
  if [ -z "$index" ] && [ "$build" = cpu ]; then
    index="$CPU_INDEX"
  fi
  index_args=()
  if [ -z "$index" ]; then
    where="the default index"
  elif reachable "${index%/}"; then
    index_args=(--index-url "$index"); where="$index"
  else
    where="the default index ($index does not answer)"
  fi
}

# "<release> <cpu|cuda>" of the torch in .venv, or "none none"
installed_torch() {
  .venv/bin/python - <<'EOF'
from importlib import metadata
try:
    dist = metadata.distribution("torch")
except metadata.PackageNotFoundError:
    raise SystemExit(print("none none"))
release, _, label = dist.version.partition("+")
is_cuda = label.startswith("cu") or any(r.startswith("nvidia-") for r in dist.requires or [])
print(release, "cuda" if is_cuda else "cpu")
EOF
}

# whether torch is missing, at another release, or installed for another choice (without a record
# of the choice: whether its build differs). An index that gave the other build is not asked twice.
needs_torch() {
  local installed
  installed="$(installed_torch)"
  if [ "${installed% *}" != "$torch_pin" ]; then
    return 0
  elif [ -f "$torch_stamp" ]; then
    [ "$(cat "$torch_stamp")" != "$torch_want" ]
  else
    [ "${installed#* }" != "$build" ]
  fi
}

choose_build
torch_pin="$(sed -n 's/^torch==//p' constraints.txt)"
torch_install=(--no-deps --force-reinstall "torch==$torch_pin")
if [ -n "${TGI_PY_INSTALL_DRY_RUN:-}" ]; then
  choose_index
  say "torch $torch_pin, $build build ($why), from $where"
  echo "pip install ${torch_install[*]} ${index_args[*]}"
  exit 0
fi

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=".venv/.tgi-py-installed"
torch_stamp=".venv/.tgi-py-torch"  # the choice the torch in .venv was installed for
torch_want="$torch_pin $build ${TGI_PY_TORCH_INDEX:-}"
inputs="$(cat pyproject.toml constraints.txt scripts/install.sh | sha256sum | cut -d' ' -f1)"
want="$inputs $build ${TGI_PY_TORCH_INDEX:-}"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  # torch alone from its index; its dependencies, like everything else, from the default index
  if needs_torch; then
    choose_index
    say "torch $torch_pin, $build build ($why), from $where; TGI_PY_TORCH=cpu|cuda chooses"
    "${PIP[@]}" "${torch_install[@]}" "${index_args[@]}"
    got="$(installed_torch)"
    if [ "${got#* }" != "$build" ]; then
      say "note: $where gave torch's ${got#* } build; set TGI_PY_TORCH_INDEX to an index" \
          "with the $build build to replace it"
    fi
  fi
  echo "$torch_want" > "$torch_stamp"
  "${PIP[@]}" -c constraints.txt -e '.[test]'
  # TGI's own Python client, for the compatibility tests. Its metadata asks for huggingface-hub<1.0,
  # which transformers 5 cannot use; it only imports build_hf_headers, which hub 1.x still has.
  "${PIP[@]}" --no-deps text-generation==0.7.0
  echo "$want" > "$stamp"
fi
