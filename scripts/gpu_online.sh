#!/usr/bin/env bash
# One device call for issue 11's figures (docs/benchmarks.md, "Engine v2"):
# the throughput workload under four engine settings (and, when ./oldtree holds
# an older checkout's src/, that version too), interleaved over ROUNDS rounds;
# latency and TTFT; `bench prefix`; and `bench pages` at GPU scale.
#
#   run (device tool):  bash scripts/gpu_online.sh      (writes under $OUT)
#
# Knobs: ROUNDS (default 2), PAGES_MIB (default 4096), SKIP_PAGES=1, SKIP_PREFIX=1.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=src TOKENIZERS_PARALLELISM=false
OUT="${OUT:-/tmp/pagedllm-gpu-online}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
MODEL=(--preset llama-3.2-1b --load-format dummy --device cuda --dtype bfloat16)
declare -A FLAGS=(
    [default]=""
    [no_prefix_cache]="--no-prefix-caching"
    [no_chunking]="--no-chunked-prefill"
    [seed_steps]="--no-chunked-prefill --no-prefix-caching"
)
summary() {  # name json -> one line
    "$PY" -c "import json,sys; r=json.load(open(sys.argv[2])); n=r.get('notes') or {}; \
print(f\"{sys.argv[1]:<18}{r.get('tokens_per_s') or 0:>10.0f} tok/s {r['seconds']:>7.3f} s \
host {r.get('host_time_per_step_ms') or 0:.3f} ms/step, {n.get('steps')} steps\")" "$1" "$2"
}
for round in $(seq "${ROUNDS:-2}"); do
    for name in default no_prefix_cache no_chunking seed_steps; do
        # shellcheck disable=SC2086
        "$PY" -m pagedllm.cli bench throughput "${MODEL[@]}" --peer none ${FLAGS[$name]} \
            --json "$OUT/tp_${name}_$round.json" >"$OUT/tp_${name}_$round.txt" 2>&1 \
            && summary "$name" "$OUT/tp_${name}_$round.json"
    done
    if [ -d oldtree/src ]; then
        (cd oldtree && PYTHONPATH=src "$PY" -m pagedllm.cli bench throughput "${MODEL[@]}" \
            --peer none --json "$OUT/tp_old_$round.json" >"$OUT/tp_old_$round.txt" 2>&1) \
            && summary "previous main" "$OUT/tp_old_$round.json"
    fi
done
for w in latency ttft; do
    "$PY" -m pagedllm.cli bench "$w" "${MODEL[@]}" --peer none --json "$OUT/$w.json" \
        >"$OUT/$w.txt" 2>&1 && grep -v '^{' "$OUT/$w.txt" | tail -n 8
    if [ -d oldtree/src ]; then
        (cd oldtree && PYTHONPATH=src "$PY" -m pagedllm.cli bench "$w" "${MODEL[@]}" --peer none \
            --json "$OUT/${w}_old.json" >"$OUT/${w}_old.txt" 2>&1) \
            && grep -v '^{' "$OUT/${w}_old.txt" | tail -n 8
    fi
done
if [ "${SKIP_PREFIX:-0}" != "1" ]; then
    "$PY" -m pagedllm.cli bench prefix "${MODEL[@]}" --json "$OUT/prefix.json" \
        >"$OUT/prefix.txt" 2>&1; grep -v '^{' "$OUT/prefix.txt" | tail -n 18
fi
if [ "${SKIP_PAGES:-0}" != "1" ]; then
    "$PY" -m pagedllm.cli bench pages "${MODEL[@]}" --num-requests 256 --max-prompt-len 1024 \
        --max-output-len 1024 --kv-cache-mib "${PAGES_MIB:-4096}" --json "$OUT/pages.json" \
        >"$OUT/pages.txt" 2>&1; echo "pages rc=$?"; grep -v '^{' "$OUT/pages.txt" | tail -n 16
fi
