#!/usr/bin/env bash
# One device call for an A/B of the workloads: the GPU tests, then `pagedllm bench`
# TTFT / batch-1 / throughput on the Llama-3.2-1B and Llama-3.1-8B presets (random
# bf16 weights, no peer), one summary line per run. Two kinds of A/B, alone or
# together:
#   - engine flags: each entry of VARIANTS in turn, alternating within a round
#     (VARIANTS="--no-async-scheduling;--async-scheduling");
#   - two commits: this tree beside an older checkout unpacked in ./oldtree,
#     for the workloads of OLD_WORKLOADS.
#
#   run (device tool, carry ["oldtree"] for the second):  bash scripts/gpu_workloads.sh
#
# Writes under $OUT (default /tmp/pagedllm-gpu-workloads): pytest.txt, and per run
# its JSON record and its output (table + log). Knobs: SKIP_TESTS=1, PRESETS
# (default "llama-3.2-1b llama-3.1-8b"), WORKLOADS (default "ttft latency throughput"),
# ROUNDS (default 1), VARIANTS (";"-separated flag sets, default one run with none),
# OLD_WORKLOADS (default "ttft"), EXTRA (more bench flags for every run, e.g.
# "--kv-cache-mib 32768").
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=src TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/pagedllm-gpu-workloads}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
if [ "${SKIP_TESTS:-0}" != "1" ]; then
    timeout 240 "$PY" -m pytest -q -m gpu -p no:cacheprovider >"$OUT/pytest.txt" 2>&1
    echo "pytest rc=$? $(tail -n 1 "$OUT/pytest.txt")"
    grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | head
fi
line() {  # label json log
    "$PY" -c "import json,sys; r=json.load(open(sys.argv[2])); \
print(f\"{sys.argv[1]:<48} tok/s {r.get('tokens_per_s') or 0:>9.1f}  ttft {r.get('ttft_ms') or 0:>8.2f} ms  \
host {r.get('host_time_per_step_ms') or 0:.3f} ms/step\")" "$1" "$2" 2>/dev/null \
        || { echo "$1: no result"; tail -n 5 "$3"; }
}
IFS=';' read -r -a VARIANT_LIST <<<"${VARIANTS:-}"
[ "${#VARIANT_LIST[@]}" -eq 0 ] && VARIANT_LIST=("")
for preset in ${PRESETS:-llama-3.2-1b llama-3.1-8b}; do
    # shellcheck disable=SC2206
    MODEL=(--preset "$preset" --load-format dummy --device cuda --dtype bfloat16 --peer none ${EXTRA:-})
    for round in $(seq "${ROUNDS:-1}"); do
        for w in ${WORKLOADS:-ttft latency throughput}; do
            for i in "${!VARIANT_LIST[@]}"; do
                variant="${VARIANT_LIST[$i]}"
                name="${preset}_${w}_r${round}_v${i}"
                # shellcheck disable=SC2086
                "$PY" -m pagedllm.cli bench "$w" "${MODEL[@]}" $variant \
                    --json "$OUT/$name.json" >"$OUT/$name.txt" 2>&1
                line "$preset $w ${variant:-(default flags)}" "$OUT/$name.json" "$OUT/$name.txt"
            done
            if [ -d oldtree/src ] && [[ " ${OLD_WORKLOADS:-ttft} " == *" $w "* ]]; then
                old="$OUT/${preset}_${w}_r${round}_old"
                (cd oldtree && PYTHONPATH=src "$PY" -m pagedllm.cli bench "$w" "${MODEL[@]}" \
                    --json "$old.json" >"$old.txt" 2>&1)
                line "$preset $w (oldtree)" "$old.json" "$old.txt"
            fi
        done
    done
done
