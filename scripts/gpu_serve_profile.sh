#!/usr/bin/env bash
# One device call: where `pagedllm serve`'s time goes all at once (issue 34's
# 85 % target). (1) The client's own floor: `vllm bench serve` (200 prompts,
# 512 in / 128 out, all at once) against the stub server of
# `python -m pagedllm.bench.serve_stub`, which answers instantly. (2) The same
# run against `pagedllm serve`, every process of it (HTTP, tokenizer workers,
# engine core) sampled by py-spy (`--subprocesses --nonblocking`, raw stacks).
#
# Needs the vLLM kit (as scripts/gpu_serve_peer.sh: a call before this one
# copied part 1 to /tmp/vllm_keep; this call carries .peer/vllm/part2) and a
# py-spy binary at $PYSPY (default .peer/tools/py-spy, carried too).
#
#   run (device, carry [".peer/vllm/part2", ".peer/tools"]): bash scripts/gpu_serve_profile.sh
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/pagedllm-serve-profile}"
mkdir -p "$OUT"
PYSPY="${PYSPY:-$PWD/.peer/tools/py-spy}"
bash .peer/vllm/part2/kit/install.sh >"$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 3; }
MODEL=/tmp/llama1b
timeout 60 python3 /tmp/vllm_kit/make_model.py $MODEL 1b >/dev/null || exit 3
export PYTHONPATH=$PWD/src:/tmp/vllm_site HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
bench() {  # bench PORT NAME
    timeout 200 python3 -m vllm.entrypoints.cli.main bench serve --backend vllm \
        --base-url "http://127.0.0.1:$1" --model $MODEL --dataset-name random \
        --random-input-len 512 --random-output-len 128 --ignore-eos --temperature 0 \
        --num-prompts 200 --request-rate inf --seed 103 --num-warmups 4 --disable-tqdm \
        >"$OUT/bench_$2.log" 2>&1
    echo "== $2"; grep -E "Benchmark duration|Output token throughput|Median TTFT|P99 TTFT|Median TPOT" "$OUT/bench_$2.log"
}
wait_health() {
    python3 - "$1" <<'PY'
import sys, time, urllib.request
t0 = time.time()
while time.time() - t0 < 120:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=1)
        print(f"ready after {time.time() - t0:.1f} s"); break
    except Exception:
        time.sleep(0.2)
PY
}
# (1) the client against the stub
python3 -m pagedllm.bench.serve_stub --port 8199 --model $MODEL >"$OUT/stub.log" 2>&1 &
STUB=$!
sleep 2
bench 8199 stub
kill $STUB
# (2) pagedllm serve, sampled
python3 -m pagedllm serve --model $MODEL --load-format dummy --device cuda --dtype bfloat16 \
    --served-model-name $MODEL --port 8101 >"$OUT/server.log" 2>&1 &
SPID=$!
wait_health 8101
"$PYSPY" record --subprocesses --nonblocking -r 250 -d 40 -f raw -o "$OUT/profile.txt" -p $SPID \
    >"$OUT/pyspy.log" 2>&1 &
SPY=$!
sleep 1
bench 8101 pagedllm
kill -INT $SPY 2>/dev/null; wait $SPY
kill -INT $SPID; wait $SPID
grep -aE "\[serve\]|\[core\]" "$OUT/server.log" | head -4
tail -3 "$OUT/pyspy.log"
ls -la "$OUT"
