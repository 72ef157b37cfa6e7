#!/usr/bin/env bash
# One device call: the engine's start-up on a cold Triton cache (a fresh
# TRITON_CACHE_DIR), with each Triton kernel's compiles counted and timed (a
# wrapper around triton's JITFunction._do_compile), Llama-3.2-1B preset, dummy
# weights. Prints the start-up log's breakdown, then one line per kernel.
#
#   run (device): bash scripts/gpu_startup_probe.sh
set -u
cd "$(dirname "$0")/.."
PY=python3
[ -d /tmp/vllm_site ] && export PYTHONPATH=$PWD/src:/tmp/vllm_site || export PYTHONPATH=$PWD/src

for n in 1; do
    export TRITON_CACHE_DIR=/tmp/triton_probe_$n
    rm -rf "$TRITON_CACHE_DIR"
    echo "== cold Triton cache"
    $PY - <<'PY'
import collections, time
import triton.runtime.jit as J
stats = collections.defaultdict(lambda: [0, 0.0])
orig = J.JITFunction._do_compile
def timed(self, *a, **k):
    t = time.perf_counter()
    try:
        return orig(self, *a, **k)
    finally:
        st = stats[self._fn_name]
        st[0] += 1
        st[1] += time.perf_counter() - t
J.JITFunction._do_compile = timed
t0 = time.perf_counter()
from pagedllm import LLM, SamplingParams
from pagedllm.presets import preset_dir
llm = LLM(str(preset_dir("llama-3.2-1b")), load_format="dummy", device="cuda", dtype="bfloat16", log=print)
print(f"LLM ready in {time.perf_counter() - t0:.1f} s")
out = llm.generate([[1, 2, 3, 4]] * 3, SamplingParams(max_tokens=8, temperature=0))
print("ok", len(out))
for name, (n, sec) in sorted(stats.items(), key=lambda kv: -kv[1][1]):
    print(f"  {name:40s} {n:3d} compiles {sec:6.2f} s")
print(f"  total {sum(v[0] for v in stats.values())} compiles {sum(v[1] for v in stats.values()):.2f} s")
PY
done
