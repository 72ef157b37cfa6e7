"""vLLM's cost of constrained decoding, measured as `bench_structured.py` measures ours.

Runs on the GPU machine with the vLLM kit installed (`/tmp/vllm_kit`, see
docs/gpu.md): the Llama-3.2-1B shape with random weights, a batch of 64
requests of 32 prompt ids each, stepped by hand (`LLMEngine.step`, engine core
in this process), unconstrained (EOS ignored) and with the same two schemas as
`bench_structured.py` (`typical`, `long string`; vLLM's default backend
choice). The figure is the median step over the steps that began with all 64
requests running, the first two left out (they prefill). Prints a table and,
last, one JSON line.

    python3 scripts/peer_structured.py          # after .peer/vllm/part2/kit/install.sh
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

KIT = os.environ.get("VLLM_KIT", "/tmp/vllm_kit")
BATCH = 64
MAX_TOKENS = 96


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_structured import LONG_STRING, TYPICAL, print_steps, prompt_ids  # noqa: E402


def run(engine, schema, seed0: int) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams

    ids = []
    for i in range(BATCH):
        params = SamplingParams(
            max_tokens=MAX_TOKENS,
            temperature=1.0,
            seed=seed0 + i,
            ignore_eos=schema is None,
            structured_outputs=None if schema is None else StructuredOutputsParams(json=schema),
        )
        rid = f"r{seed0}-{i}"
        engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt_ids(seed0, i)), params)
        ids.append(rid)
    done: set[str] = set()
    steps = []  # (seconds, requests running when the step began)
    while engine.has_unfinished_requests():
        running = BATCH - len(done)
        t0 = time.perf_counter()
        outs = engine.step()
        steps.append((time.perf_counter() - t0, running))
        done.update(o.request_id for o in outs if o.finished)
    full = [t for t, n in steps if n == BATCH][2:]
    return {
        "steps": len(steps),
        "full_steps": len(full),
        "median_step_ms": 1e3 * statistics.median(full) if full else None,
    }


def main() -> int:
    sys.path.insert(0, KIT)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # step() is one core step
    from offline import ensure_env  # the kit's: re-runs this script with vLLM's site first

    ensure_env()
    from make_model import make

    model_dir = make("/tmp/llama1b", "1b")
    import torch
    import vllm
    from vllm import LLM

    t0 = time.time()
    llm = LLM(
        model=model_dir,
        load_format="dummy",
        dtype="bfloat16",
        max_model_len=4096,
        seed=0,
        max_num_seqs=BATCH,
        gpu_memory_utilization=0.8,
    )
    init_s = time.time() - t0
    engine = llm.llm_engine
    rows = {"unconstrained": run(engine, None, 1)}
    for name, schema in {"typical": TYPICAL, "long string": LONG_STRING}.items():
        rows[name] = run(engine, schema, 2 if name == "typical" else 3)
    print(f"vLLM {vllm.__version__}, {torch.cuda.get_device_name()}, engine init {init_s:.1f} s")
    print(f"batch {BATCH}, Llama-3.2-1B shape, dummy weights")
    print_steps(rows)
    print(json.dumps({"bench": "structured", "engine": f"vllm {vllm.__version__}", "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
