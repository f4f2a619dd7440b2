#!/usr/bin/env bash
# GPU check for the lent H200 machine (Python 3.12, torch 2.11 cu130, nvcc 13.0, no package registry).
#
#   bash scripts/gpu_check.sh
#
# 1. installs carried wheels (.whl/*.whl, e.g. pyzmq/fastapi/uvicorn) into a --target dir on PYTHONPATH;
# 2. builds and installs k2-kernels with its CUDA kernels (16 cores) and checks the sm_90a cubin;
# 3. installs the pure-Python packages (pip --no-deps --no-build-isolation when hatchling is
#    importable, else their src/ dirs go on PYTHONPATH);
# 4. runs `python -m k2_kernels.selfcheck`, every `cuda`-marked test (pytest -m cuda), a 2-iteration
#    `k2 rl --device cuda`, every benchmarks/*.py that accepts --device, then the self-check under compute-sanitizer
#    (memcheck, racecheck) while time is left;
# 5. prints a summary. Logs go to $OUT (or ./gpu-check-out): at most 6 files, to fit what comes back.
# Whole run budgeted under 8 minutes. Exit status: 0 when every step passed.
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT="$PWD"
OUT="${OUT:-$ROOT/gpu-check-out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-16}"
export PATH="/usr/local/cuda/bin:/usr/local/cuda-13.0/bin:$PATH"
export K2_CUDA=ON K2_CUDA_ARCHS="${K2_CUDA_ARCHS:-90a}"
START=$(date +%s)

declare -a SUMMARY=()
FAILED=0
note() { printf '\n=== %s (t=%ss) ===\n' "$*" "$(( $(date +%s) - START ))"; }
record() {  # record NAME STATUS SECONDS (statuses ok, skip and slow do not fail the run)
  SUMMARY+=("$(printf '%-40s %-7s %4ss' "$1" "$2" "$3")")
  case "$2" in ok | skip | slow) ;; *) FAILED=1 ;; esac
}
# run_step NAME LOGFILE TIMEOUT_S CMD...: runs CMD with a time limit, appends to LOGFILE, records the outcome.
run_step() {
  local name="$1" log="$2" limit="$3"; shift 3
  local t0 rc=0
  t0=$(date +%s)
  note "$name"
  { echo "### $name: $*"; } >>"$log"
  timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1 || rc=$?
  local dt=$(( $(date +%s) - t0 ))
  if [ "$rc" -eq 0 ]; then record "$name" ok "$dt"
  elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    # SOFT_TIMEOUT=1: running out of time is not a failure (the sanitizer runs)
    record "$name" "$([ "${SOFT_TIMEOUT:-0}" = 1 ] && echo slow || echo TIMEOUT)" "$dt"
    echo "TIMEOUT after ${limit}s: $name" | tee -a "$log"
  elif grep -q "Device not supported" "$log" 2>/dev/null && [[ "$name" == sanitizer* ]]; then
    record "$name" skip "$dt"; echo "compute-sanitizer does not support this device here: $name skipped"
  else record "$name" FAIL "$dt"; echo "FAILED (rc=$rc): $name; last lines of $log:"; tail -n 25 "$log"; fi
  return 0
}

# ---- environment ------------------------------------------------------------------------------
note "environment"
{
  date -u; echo "commit: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || echo "no nvidia-smi"
  command -v nvcc >/dev/null && nvcc --version | tail -n 2 || echo "no nvcc on PATH"
  "$PY" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.is_available() and torch.cuda.get_device_name(0))"
} 2>&1 | tee "$OUT/env.log"
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  if [ "${K2_GPU_CHECK_ALLOW_CPU:-0}" = 1 ]; then
    echo "WARNING: no CUDA GPU; dry run (K2_GPU_CHECK_ALLOW_CPU=1): cuda tests will be skipped" | tee -a "$OUT/env.log"
  else
    echo "ERROR: torch sees no CUDA GPU on this machine; nothing to check (K2_GPU_CHECK_ALLOW_CPU=1 for a dry run)." | tee -a "$OUT/env.log"
    exit 2
  fi
fi

# ---- carried wheels ---------------------------------------------------------------------------
SITE=/tmp/k2-gpu-site
if compgen -G ".whl/*.whl" >/dev/null; then
  run_step "install carried wheels (.whl)" "$OUT/install.log" 120 \
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
else
  record "install carried wheels (.whl)" skip 0
fi

# ---- k2-kernels (CUDA) ------------------------------------------------------------------------
run_step "build+install k2-kernels (CUDA)" "$OUT/install.log" 300 \
  "$PY" -m pip install -v --no-deps --no-build-isolation --no-index packages/k2-kernels
run_step "check sm_90a cubin in k2_kernels._C" "$OUT/install.log" 60 "$PY" scripts/check_cuda_build.py
"$PY" -c "import k2_kernels; print(k2_kernels.info())" 2>&1 | tee -a "$OUT/install.log" || true

# ---- pure-Python packages -----------------------------------------------------------------------
PY_PKGS=()
for p in packages/*/; do
  if [ "$p" != "packages/k2-kernels/" ] && [ -f "$p/pyproject.toml" ]; then PY_PKGS+=("$p"); fi
done
if "$PY" -c "import hatchling" 2>/dev/null; then
  run_step "install python packages (pip)" "$OUT/install.log" 180 \
    "$PY" -m pip install -q --no-deps --no-build-isolation --no-index "${PY_PKGS[@]}" .
else
  # No hatchling there (and no registry): use the sources in place; they are pure Python.
  for p in "${PY_PKGS[@]}"; do PYTHONPATH="$ROOT/${p%/}/src:${PYTHONPATH:-}"; done
  export PYTHONPATH="$ROOT/src:$PYTHONPATH"
  echo "hatchling missing: python packages used from source via PYTHONPATH" | tee -a "$OUT/install.log"
  record "install python packages (PYTHONPATH)" ok 0
fi

# ---- quick self-check -------------------------------------------------------------------------
if [ "${K2_GPU_CHECK_ALLOW_CPU:-0}" != 1 ]; then
  run_step "k2_kernels.selfcheck (cuda)" "$OUT/pytest.log" 120 "$PY" -m k2_kernels.selfcheck --device cuda
fi

# ---- cuda tests -------------------------------------------------------------------------------
# Collection errors (a package whose optional deps are missing here) must not hide the cuda tests.
run_step "pytest -m cuda" "$OUT/pytest.log" 240 \
  "$PY" -m pytest -m cuda -q -rfEs --continue-on-collection-errors -p no:cacheprovider
grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed|skipped)" "$OUT/pytest.log" | tail -n 30 || true
if [ "${K2_GPU_CHECK_ALLOW_CPU:-0}" != 1 ] && ! grep -qE "[0-9]+ passed" "$OUT/pytest.log"; then
  record "cuda tests actually ran" FAIL 0  # on a GPU machine, all-skipped means something is off
fi

# ---- a short k2 rl run on the GPU (trainer and rollout worker on cuda, weights synced by k2-ckpt) --
if [ "${K2_GPU_CHECK_ALLOW_CPU:-0}" = 1 ]; then
  record "k2 rl --device cuda (2 iterations)" skip 0
else
  run_step "k2 rl --device cuda (2 iterations)" "$OUT/pytest.log" 120 \
    "$PY" -m k2_stack rl --device cuda --iterations 2 --prompts-per-iteration 8 --samples-per-prompt 4 \
    --max-response-tokens 32 --eval-every 2 --eval-prompts 16 --save-every 0 --out /tmp/k2-gpu-rl
  grep -E "^rl iteration|Newton-Schulz|k2 rl:" "$OUT/pytest.log" | tail -n 6 || true
fi

# ---- GPU benchmarks ---------------------------------------------------------------------------
shopt -s nullglob
BENCHES=()
for b in benchmarks/*.py; do grep -q -- "--device" "$b" && BENCHES+=("$b"); done
if [ "${K2_GPU_CHECK_ALLOW_CPU:-0}" = 1 ]; then BENCHES=(); echo "dry run: benchmarks skipped"; fi
if [ "${#BENCHES[@]}" -eq 0 ]; then record "benchmarks (--device cuda)" skip 0; fi
for b in "${BENCHES[@]}"; do
  left=$(( 460 - ($(date +%s) - START) ))  # keep the whole script under 8 minutes
  if [ "$left" -lt 20 ]; then record "bench $(basename "$b")" skip 0; echo "skipping $b: time budget spent"; continue; fi
  run_step "bench $(basename "$b")" "$OUT/bench.log" "$(( left < 150 ? left : 150 ))" "$PY" "$b" --device cuda
done

# ---- compute-sanitizer (out-of-bounds accesses, shared-memory races) on the quick self-check ------
if [ "${K2_GPU_CHECK_ALLOW_CPU:-0}" = 1 ] || ! command -v compute-sanitizer >/dev/null; then
  record "sanitizer (memcheck, racecheck)" skip 0
else
  for tool in memcheck racecheck; do
    left=$(( 470 - ($(date +%s) - START) ))
    if [ "$left" -lt 30 ]; then record "sanitizer $tool" skip 0; continue; fi
    SOFT_TIMEOUT=1 run_step "sanitizer $tool" "$OUT/sanitizer.log" "$(( left < 150 ? left : 150 ))" \
      compute-sanitizer --tool "$tool" --error-exitcode 3 \
      "$PY" -m k2_kernels.selfcheck --device cuda --quick
  done
fi

# ---- summary ----------------------------------------------------------------------------------
{
  echo "# gpu_check summary ($(date -u +%FT%TZ), $(( $(date +%s) - START ))s)"
  echo
  echo '```'
  printf '%s\n' "${SUMMARY[@]}"
  echo '```'
  echo
  echo "pytest: $(grep -E '[0-9]+ (passed|failed|skipped|error|deselected)' "$OUT/pytest.log" | tail -n 1 || echo 'no result line')"
  if [ -f "$OUT/pytest.log" ]; then echo; echo '```'; grep -E "^rl iteration|Newton-Schulz" "$OUT/pytest.log" || true; echo '```'; fi
  if [ -f "$OUT/bench.log" ]; then echo; echo '```'; grep -E '^\|' "$OUT/bench.log" || true; echo '```'; fi
  if [ "$FAILED" -eq 0 ]; then echo "RESULT: all steps passed"; else echo "RESULT: some steps FAILED (see logs in $OUT)"; fi
} | tee "$OUT/summary.md"
exit "$FAILED"
