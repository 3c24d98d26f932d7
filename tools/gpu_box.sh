#!/usr/bin/env bash
# A GPU box session in two steps (docs/how-to/gpus.md, "Checking on a GPU box"):
#   tools/gpu_box.sh wheels   here, where pip reaches the package index: wheels of what the box's image lacks
#                             (at the versions .venv has) into .whl/, and MNIST into shared/data/mnist/
#   tools/gpu_box.sh check    on the box, from the repository root: a venv over the image's python (whose CUDA
#                             torch it sees) with those wheels and fedpar, then `make gpu-check` with it
# GPU_VENV (default ~/fedpar-venv) is where the venv goes; the rest of make gpu-check's variables pass through.
set -euo pipefail
cd "$(dirname "$0")/.."
# not in the box's image; flwr and what it imports that the image lacks, for the Flower tests
MISSING="cryptography cffi pycparser opacus grpcio grpcio-health-checking protobuf flwr pycryptodome iterators tomli tomli_w"

case "${1:-}" in
wheels)
  pins=$(.venv/bin/python -m pip list --format=freeze 2>/dev/null | grep -iE "^($(echo $MISSING | tr ' ' '|'))==" )
  mkdir -p .whl
  # the box's image python (3.12 on 2026-11-27: ../shared/notes/gpu-box.md); GPU_PYTHON_VERSION if it changed
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${GPU_PYTHON_VERSION:-3.12}" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl $pins
  if [ -d ../shared/data/mnist ]; then mkdir -p shared/data && cp -r ../shared/data/mnist shared/data/; fi
  echo "wheels in .whl/ ($(ls .whl | wc -l) files); carry .whl with the checkout (shared/ travels by itself)"
  ;;
check)
  venv=${GPU_VENV:-$HOME/fedpar-venv}
  if [ ! -f "$venv/.fedpar-installed" ]; then  # stamped once every install went through
    rm -rf "$venv"
    python3 -m venv "$venv"
    site=$("$venv/bin/python" -c "import site; print(site.getsitepackages()[0])")
    python3 -c "import site; print(site.getsitepackages()[0])" > "$site/image.pth"  # the image's torch
    "$venv/bin/pip" install -q --no-index --no-deps --no-compile .whl/*.whl
    "$venv/bin/pip" install -q --no-index --no-deps --no-build-isolation -e .
    touch "$venv/.fedpar-installed"
  fi
  shift
  make gpu-check GPU_PY="$venv/bin/python" "$@"
  ;;
*)
  echo "usage: tools/gpu_box.sh wheels | check [make variables]" >&2
  exit 2
  ;;
esac
