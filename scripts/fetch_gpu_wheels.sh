#!/usr/bin/env bash
# Download the wheels k2-ckpt needs on the lent GPU machine (Python 3.12, no package registry)
# into .whl/, which scripts/gpu_check.sh installs first (--target dir on PYTHONPATH).
#
#   bash scripts/fetch_gpu_wheels.sh            # then name .whl in the device run's `carry`
#
# The GPU image already has torch, numpy, safetensors, httpx, anyio, click, h11 (see
# /work/.library/device/KINDS.md) but not pyzmq, fastapi, starlette, uvicorn or pydantic.
# We carry the whole import closure of k2-ckpt's non-torch dependencies, pinned to the versions
# of the local .venv (the combination the CPU tests pass with), so the carried set is
# self-consistent and never mixes with older copies there. --no-deps: each one is named here.
# Only one version of each: two would stop the whole install on the GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY_LOCAL="${PY_LOCAL:-.venv/bin/python}"   # whose versions are pinned
PIP="${PIP:-python3 -m pip}"
DEST=.whl

# k2-ckpt: pyzmq fastapi uvicorn pydantic safetensors httpx, and what they import
NAMES=(pyzmq fastapi starlette uvicorn pydantic pydantic-core annotated-types annotated-doc
       typing-extensions typing-inspection opentelemetry-api anyio sniffio idna h11 click
       httpx httpcore certifi safetensors
       # k2-kernels: the OpenBLAS its CPU kernels call (optional there: a built-in GEMM otherwise)
       scipy-openblas32)

grep -qxF "/.whl/" .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo /.whl/ >> .git/info/exclude; }
mkdir -p "$DEST"

pins=()
for n in "${NAMES[@]}"; do
  v=$("$PY_LOCAL" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$n" 2>/dev/null) || {
    echo "fetch_gpu_wheels: $n is not installed in $PY_LOCAL; cannot pin its version" >&2; exit 2; }
  pins+=("$n==$v")
done

# manylinux tags as the device README lists them; pip matches the glibc version N exactly
$PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 \
  -d "$DEST" "${pins[@]}"

# one version of each name: drop stale wheels left by an earlier run with other pins
for n in "${NAMES[@]}"; do
  stem=$(echo "$n" | tr '-' '_')
  keep=$(printf '%s\n' "${pins[@]}" | grep -i "^$n==" | cut -d= -f3)
  for f in "$DEST"/*.whl; do
    base=$(basename "$f")
    name=${base%%-*}
    ver=$(echo "$base" | cut -d- -f2)
    if [ "${name,,}" = "${stem,,}" ] && [ "$ver" != "$keep" ]; then echo "removing stale $base"; rm -f "$f"; fi
  done
done

count=$(ls "$DEST"/*.whl | wc -l)
echo "fetch_gpu_wheels: $count wheels in $DEST ($(du -sh "$DEST" | cut -f1)); expected ${#NAMES[@]}"
ls "$DEST"
[ "$count" -eq "${#NAMES[@]}" ] || { echo "fetch_gpu_wheels: wheel count does not match the names" >&2; exit 1; }
