#!/usr/bin/env bash
# One device call: `pytest -m gpu`, then throughput and batch-1 decode on the
# 1B (two rounds) and 8B presets, each without and with async scheduling,
# alternating (docs/benchmarks.md, "Async scheduling").
#
#   run (device tool):  bash scripts/gpu_async_ab.sh
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider > $OUT/pytest.txt 2>&1; echo "pytest rc=$? $(tail -n 1 $OUT/pytest.txt)"; grep -E "^(FAILED|ERROR)|Error" $OUT/pytest.txt | head -5
line() { python3 -c "import json,sys; r=json.load(open(sys.argv[2])); print(f\"{sys.argv[1]:<34} tok/s {r.get('tokens_per_s') or 0:>9.1f} ttft {r.get('ttft_ms') or 0:>8.2f} ms host {r.get('host_time_per_step_ms') or 0:.3f} ms/step\")" "$1" "$2" 2>/dev/null || { echo "$1: failed"; tail -n 5 "$3"; }; }
for preset in llama-3.2-1b llama-3.1-8b; do
  M="--preset $preset --load-format dummy --device cuda --dtype bfloat16 --peer none"
  ws="throughput latency"; rounds="1 2"; [ $preset = llama-3.1-8b ] && rounds="1"
  for r in $rounds; do for w in $ws; do for a in no-async-scheduling async-scheduling; do
    python3 -m pagedllm.cli bench $w $M --$a --json $OUT/j.json > $OUT/t.txt 2>&1
    line "$preset $w --$a" $OUT/j.json $OUT/t.txt
  done; done; done
done
rm -f $OUT/j.json $OUT/t.txt
