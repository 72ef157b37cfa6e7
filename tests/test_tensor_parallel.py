"""Tensor parallelism on the CPU: two processes over gloo, each with half of the
model, against the whole model in this process.

Oracle: the same model loaded whole (TP=1), itself proven against transformers
elsewhere (test_model_parity.py). Float32, so the sharded sums may differ from
the whole ones only by summation order.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch

from pagedllm.model import load_model
from pagedllm.model.parallel import TensorParallel, check_divisible, shard_config, shard_weight
from tiny_models import make_tiny_llama_dir

PROMPTS = [[5, 9, 13, 2, 7, 7, 30, 11, 4], [1, 300, 2, 509, 44], list(range(40, 77))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, size: int, port: int, paths: list[str], out_dir: str) -> None:
    """One rank: load its shard of each model, run forward_logits and an engine."""
    import torch.distributed as dist

    from pagedllm import SamplingParams
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.engine_config import EngineConfig

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
    )
    try:
        result = {}
        for path in paths:
            model = load_model(path, "cpu", "float32", tp=TensorParallel(rank, size))
            logits = model.forward_logits(PROMPTS[0])
            # Every rank runs the same engine steps (the same plan each step), so the
            # collectives inside the forward passes line up: paged prefill + decode.
            engine = LLMEngine(
                EngineConfig(kv_cache_mib=1, block_size=4), model, log=lambda m: None
            )
            params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
            reqs = [engine.add_request(p, params) for p in PROMPTS]
            while engine.has_unfinished():
                engine.step()
            tokens = [r.output_token_ids for r in reqs]
            k_cache = engine.runner.kv_caches[0][0]
            result[path] = {
                "logits": logits.tolist(),
                "tokens": tokens,
                "kv_heads": k_cache.shape[2],
                "embed_rows": model.embed_tokens.shape[0],
            }
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    untied, _ = make_tiny_llama_dir(root / "untied", seed=3, num_key_value_heads=2, vocab_size=511)
    tied, _ = make_tiny_llama_dir(
        root / "tied", seed=4, num_key_value_heads=2, tie_word_embeddings=True
    )
    return [str(untied), str(tied)]


def whole_model_results(path: str) -> dict:
    from pagedllm import SamplingParams
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.engine_config import EngineConfig

    model = load_model(path, "cpu", "float32")
    engine = LLMEngine(EngineConfig(kv_cache_mib=1, block_size=4), model, log=lambda m: None)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    reqs = [engine.add_request(p, params) for p in PROMPTS]
    while engine.has_unfinished():
        engine.step()
    return {
        "logits": model.forward_logits(PROMPTS[0]),
        "tokens": [r.output_token_ids for r in reqs],
        "kv_heads": engine.runner.kv_caches[0][0].shape[2],
    }


def test_two_ranks_over_gloo_equal_one(models, tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_rank_main, args=(2, free_port(), models, str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for path in models:
        whole = whole_model_results(path)
        for r in ranks:
            got = r[path]
            torch.testing.assert_close(
                torch.tensor(got["logits"]), whole["logits"], rtol=1e-4, atol=1e-4
            )
            assert got["tokens"] == whole["tokens"]
            assert got["kv_heads"] * 2 == whole["kv_heads"]  # each rank caches half the heads
    # Vocabulary-parallel rows: ceil(511 / 2) = 256 per rank, the last one padded.
    assert ranks[0][models[0]]["embed_rows"] == ranks[1][models[0]]["embed_rows"] == 256


def test_shard_weight_slices():
    tp = TensorParallel(1, 2)
    w = torch.arange(6 * 4).reshape(6, 4)
    assert torch.equal(shard_weight("model.layers.0.self_attn.q_proj.weight", w, tp), w[3:])
    assert torch.equal(shard_weight("model.layers.3.mlp.down_proj.weight", w, tp), w[:, 2:])
    assert torch.equal(shard_weight("model.layers.0.input_layernorm.weight", w, tp), w)
    emb = torch.ones(5, 3)  # 5 rows over 2 ranks: 3 each, the last padded with zeros
    got = shard_weight("model.embed_tokens.weight", emb, tp)
    assert got.shape == (3, 3) and got[:2].eq(1).all() and got[2].eq(0).all()
    assert tp.vocab_rows(5) == (3, 6)
    with pytest.raises(ValueError, match="rank 2 is not in 0..1"):
        TensorParallel(2, 2)


def test_indivisible_sizes_are_refused_with_the_choices(models):
    config = load_model(models[0], "cpu", "float32").config  # 4 heads, 2 KV heads, I = 128
    assert shard_config(config, 2).num_key_value_heads == 1
    with pytest.raises(ValueError, match=r"does not divide the model's 2 KV heads.*one of 1, 2"):
        check_divisible(config, 4)
    with pytest.raises(ValueError, match="positive integer"):
        check_divisible(config, 0)
