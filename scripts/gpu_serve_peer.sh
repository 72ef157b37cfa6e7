#!/usr/bin/env bash
# One device call: `vllm serve` and `pagedllm serve` under the same client
# (`vllm bench serve`, random 512-token prompts, 128 output tokens, EOS ignored,
# 200 requests per rate, RATES), then pagedllm's engine alone on the same draw
# (`pagedllm bench throughput --num-requests 200 --prompt-len 512 --output-len 128`).
# docs/benchmarks.md, "Serving: the engine core in its own process", keeps the figures.
#
# Needs vLLM's kit on the machine: a call before this one copied part 1 of the
# bundle to /tmp/vllm_keep (carry .peer/vllm/part1), and this call carries
# .peer/vllm/part2, whose install.sh installs vLLM and the server's packages
# (fastapi, uvicorn, pyzmq, msgspec, ...) into /tmp/vllm_site. The bundle is
# built once by the maintainers' vLLM bundle script (not in this repository).
#
#   run (device, carry [".peer/vllm/part2"]):  bash scripts/gpu_serve_peer.sh
#
# Knobs: RATES ("16 64 inf"), SKIP_VLLM=1, SKIP_OFFLINE=1, SHAPE (1b), EXTRA (more
# `pagedllm serve` flags). Output: $OUT/{vllm,ours}/ (server.log, bench.log,
# serve_summary.json) and the tables on stdout.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/pagedllm-serve-peer}"
mkdir -p "$OUT"
export RATES="${RATES:-16 64 inf}" MODEL_SHAPE="${SHAPE:-1b}"
bash .peer/vllm/part2/kit/install.sh >"$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 3; }
KIT=/tmp/vllm_kit
if [ "${SKIP_VLLM:-0}" != "1" ]; then
    OUT=$OUT/vllm DEADLINE="${VLLM_DEADLINE:-240}" bash $KIT/serve.sh 2>&1 | tail -n 6
fi
ROOT=$PWD
OUT=$OUT/ours DEADLINE="${OURS_DEADLINE:-170}" PORT=8101 LABEL=pagedllm \
    SERVER_CMD="PYTHONPATH=$ROOT/src:/tmp/vllm_site python3 -m pagedllm serve --model \$MODEL \
--load-format dummy --device cuda --dtype bfloat16 --served-model-name \$MODEL --port \$PORT \
${EXTRA:-}" bash $KIT/serve.sh 2>&1 | tail -n 6
grep -aE "\[serve\]|\[core\]" "$OUT/ours/server.log" | head -12
if [ "${SKIP_OFFLINE:-0}" != "1" ]; then
    PYTHONPATH=$ROOT/src:/tmp/vllm_site python3 -m pagedllm bench throughput \
        --model /tmp/llama"$MODEL_SHAPE" --load-format dummy --device cuda --dtype bfloat16 \
        --peer none --num-requests 200 --prompt-len 512 --output-len 128 2>&1 |
        grep -E "output tokens/s|wall time|first token|per output"
fi
# Time to ready again, now that Triton's cache holds every kernel (a user's second start).
if [ "${READY_AGAIN:-1}" = "1" ]; then
    PYTHONPATH=$ROOT/src:/tmp/vllm_site python3 -m pagedllm serve --model /tmp/llama"$MODEL_SHAPE" \
        --load-format dummy --device cuda --dtype bfloat16 --port 8102 >"$OUT/ready_again.log" 2>&1 &
    pid=$!
    python3 - <<'PY'
import time, urllib.request
t0 = time.time()
while time.time() - t0 < 120:
    try:
        urllib.request.urlopen("http://localhost:8102/health", timeout=1)
        break
    except Exception:
        time.sleep(0.1)
print(f"ready again (warm Triton cache): {time.time() - t0:.1f} s after the launch")
PY
    kill -INT $pid; wait $pid
    grep -aE "\[serve\]|\[core\]" "$OUT/ready_again.log" | head -12
fi
