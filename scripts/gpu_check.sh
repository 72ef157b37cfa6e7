#!/usr/bin/env bash
# One device call: the GPU tests, then the three workloads of docs/gpu.md on the
# Llama-3.2-1B preset (beside transformers) and the Llama-3.1-8B preset (ours
# only: transformers' 8B throughput run would not fit the call), random bf16 weights.
#
#   run (device tool):  PAGEDLLM_COMMIT=<short sha> bash scripts/gpu_check.sh
#   (the copy on the GPU machine may have no .git: the commit is passed in)
#
# Writes under $OUT (default /tmp/pagedllm-gpu-check): pytest.txt, nvidia-smi.txt,
# and for each preset P and workload W: P_W.json (the record), P_W.txt (table +
# JSON), P_W.log (stderr). Prints a short table last. Runs from the source tree
# (PYTHONPATH=src); needs torch, triton and transformers only (no gguf, no fastapi).
#
# Knobs (environment): SKIP_TESTS=1, PRESETS="llama-3.2-1b llama-3.1-8b",
# PEER=none (no transformers beside the 1B preset), WORKLOADS="latency ttft",
# BUDGET_S (default 570: the whole script stays under one 600 s device call).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false
OUT="${OUT:-/tmp/pagedllm-gpu-check}"
PY="${PYTHON:-python3}"
PEER="${PEER:-hf}"
WORKLOADS="${WORKLOADS:-throughput latency ttft}"
PRESETS="${PRESETS:-llama-3.2-1b llama-3.1-8b}"
BUDGET_S="${BUDGET_S:-570}"
mkdir -p "$OUT"

# Seconds a step may take: its own cap, and never past the whole budget.
cap() {
    local left=$((BUDGET_S - SECONDS - 15))
    if [ "$left" -lt "$1" ]; then echo "$((left > 5 ? left : 5))"; else echo "$1"; fi
}

nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv \
    >"$OUT/nvidia-smi.txt" 2>&1 || true
"$PY" -c "import torch, triton, transformers; print('torch', torch.__version__, '| triton', \
triton.__version__, '| transformers', transformers.__version__)" | tee "$OUT/versions.txt"

# 1. GPU tests.
if [ "${SKIP_TESTS:-0}" != "1" ]; then
    echo "== pytest -m gpu"
    timeout "$(cap 120)" "$PY" -m pytest -q -m gpu -p no:cacheprovider >"$OUT/pytest.txt" 2>&1
    echo "pytest rc=$?"
    tail -n 15 "$OUT/pytest.txt"
fi

# 2. The three workloads per preset (throughput first: it is the longest and matters most).
declare -A CAPS=([throughput]=200 [latency]=70 [ttft]=50)
for preset in $PRESETS; do
    peer="$PEER"
    [ "$preset" != "llama-3.2-1b" ] && peer=none
    COMMON=(--preset "$preset" --load-format dummy --device cuda --dtype bfloat16 --peer "$peer")
    for w in $WORKLOADS; do
        echo "== $preset bench $w"
        timeout "$(cap "${CAPS[$w]}")" "$PY" -m pagedllm.cli bench "$w" "${COMMON[@]}" \
            --json "$OUT/${preset}_$w.json" >"$OUT/${preset}_$w.txt" 2>"$OUT/${preset}_$w.log"
        rc=$?
        echo "bench $w rc=$rc ($SECONDS s so far)"
        [ "$rc" -ne 0 ] && tail -n 8 "$OUT/${preset}_$w.log"
        grep -v '^{' "$OUT/${preset}_$w.txt" | tail -n 14
    done
done

# 3. The short table, last.
echo
echo "== summary (presets with dummy bf16 weights; ratio > 1 means pagedllm is better)"
"$PY" - "$OUT" $PRESETS <<'EOF'
import json, pathlib, sys

out = pathlib.Path(sys.argv[1])
rows = [("throughput", "tokens_per_s", "output tok/s"), ("latency", "tokens_per_s", "decode tok/s"),
        ("ttft", "ttft_ms", "TTFT ms (median)")]
print(f"{'preset':<14}{'workload':<12}{'metric':<18}{'pagedllm':>12}{'transformers':>14}{'ratio':>8}  extra")
r = {}
for preset in sys.argv[2:]:
    for name, key, label in rows:
        path = out / f"{preset}_{name}.json"
        if not path.is_file():
            print(f"{preset:<14}{name:<12}{label:<18}{'(no result)':>12}")
            continue
        r = json.loads(path.read_text())
        peer = r.get("peer") or {}
        fmt = lambda v: "-" if v is None else f"{v:.1f}"
        extra = f"commit {r.get('commit')}"
        if name == "latency" and r.get("achieved_gbps") is not None:
            extra = (f"{r['achieved_gbps']:.0f} GB/s = {100 * r.get('bandwidth_fraction', 0):.1f}% of "
                     f"{r.get('bandwidth_gbps')} GB/s; floor {r.get('floor_tokens_per_s')} tok/s")
        if name == "throughput":
            extra = f"{r.get('seconds', 0):.1f} s; host {fmt(r.get('host_time_per_step_ms'))} ms/step"
        ratio = r.get("ratio")
        print(f"{preset:<14}{name:<12}{label:<18}{fmt(r.get(key)):>12}{fmt(peer.get(key)):>14}"
              f"{'-' if ratio is None else f'{ratio:.2f}x':>8}  {extra}"
              + ("  (peer not finished)" if r.get("peer_status") else ""))
print(f"device: {r.get('device', '?')}")
EOF
