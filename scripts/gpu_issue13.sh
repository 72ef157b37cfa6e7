#!/usr/bin/env bash
# One device call for issue 13's figures: the GPU tests, then TTFT / batch-1 /
# throughput on the Llama-3.2-1B and Llama-3.1-8B presets (random bf16 weights),
# this tree beside an older checkout unpacked in ./oldtree (when present).
#
#   run (device tool, carry ["oldtree"]):  bash scripts/gpu_issue13.sh      (writes under $OUT)
#
# Knobs: SKIP_TESTS=1, PRESETS (default "llama-3.2-1b llama-3.1-8b"),
# WORKLOADS (default "ttft latency throughput"), OLD_WORKLOADS (default "ttft"),
# EXTRA (more bench flags, e.g. "--kv-cache-mib 32768").
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=src TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/pagedllm-gpu-issue13}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
if [ "${SKIP_TESTS:-0}" != "1" ]; then
    timeout 240 "$PY" -m pytest -q -m gpu -p no:cacheprovider >"$OUT/pytest.txt" 2>&1
    echo "pytest rc=$? $(tail -n 1 "$OUT/pytest.txt")"
    grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | head
fi
line() {  # label json
    "$PY" -c "import json,sys; r=json.load(open(sys.argv[2])); \
print(f\"{sys.argv[1]:<34} tok/s {r.get('tokens_per_s') or 0:>9.1f}  ttft {r.get('ttft_ms') or 0:>8.2f} ms  \
host {r.get('host_time_per_step_ms') or 0:.3f} ms/step\")" "$1" "$2" 2>/dev/null || echo "$1: no result"
}
for preset in ${PRESETS:-llama-3.2-1b llama-3.1-8b}; do
    # shellcheck disable=SC2206
    MODEL=(--preset "$preset" --load-format dummy --device cuda --dtype bfloat16 --peer none ${EXTRA:-})
    for w in ${WORKLOADS:-ttft latency throughput}; do
        "$PY" -m pagedllm.cli bench "$w" "${MODEL[@]}" --json "$OUT/${preset}_$w.json" \
            >"$OUT/${preset}_$w.txt" 2>&1
        line "$preset $w" "$OUT/${preset}_$w.json"
        if [ -d oldtree/src ] && [[ " ${OLD_WORKLOADS:-ttft} " == *" $w "* ]]; then
            (cd oldtree && PYTHONPATH=src "$PY" -m pagedllm.cli bench "$w" "${MODEL[@]}" \
                --json "$OUT/${preset}_${w}_old.json" >"$OUT/${preset}_${w}_old.txt" 2>&1)
            line "$preset $w (oldtree)" "$OUT/${preset}_${w}_old.json"
        fi
    done
done
