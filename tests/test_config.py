"""ModelConfig refuses the values no model has, naming the key and the file.

Owns: the tests of `pagedllm.config` value checks, from `config.json` and from
GGUF metadata. Each bad value used to become a wrong model (NaN RoPE angles, a
17 GB RoPE table, `bool("no") == True`) or a TypeError deep inside the loader.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest

from pagedllm.config import MAX_POSITIONS, ModelConfig
from tiny_models import BASE_CONFIG

GGUF_BASE: dict[str, Any] = {
    "general.architecture": "llama",
    "llama.embedding_length": 64,
    "llama.feed_forward_length": 128,
    "llama.attention.head_count": 4,
    "llama.attention.head_count_kv": 1,
    "llama.block_count": 2,
    "llama.context_length": 1024,
    "llama.rope.freq_base": 500000.0,
    "llama.attention.layer_norm_rms_epsilon": 1e-5,
    "llama.vocab_size": 512,
}

DROP = object()  # an override that removes the key

HF_BAD: list[tuple[str, Any, str]] = [
    # (key, value, what the message must say besides the key)
    ("rope_theta", math.nan, "finite number > 0"),
    ("rope_theta", 0.0, "finite number > 0"),
    ("rope_theta", -10000.0, "finite number > 0"),
    ("rope_theta", math.inf, "finite number > 0"),
    ("rope_theta", "10000", "a number"),
    ("rms_norm_eps", math.nan, "finite number >= 0"),
    ("rms_norm_eps", -1e-5, "finite number >= 0"),
    ("tie_word_embeddings", "no", "true or false"),
    ("tie_word_embeddings", 0, "true or false"),
    ("hidden_size", None, "an integer"),
    ("hidden_size", 64.5, "an integer"),
    ("hidden_size", True, "an integer"),
    ("hidden_size", "64", "an integer"),
    ("hidden_size", DROP, "missing required key"),
    ("vocab_size", 0, ">= 1"),
    ("intermediate_size", -128, ">= 1"),
    ("num_hidden_layers", 0, ">= 1"),
    ("num_attention_heads", 0, ">= 1"),
    ("num_key_value_heads", 0, ">= 1"),
    ("num_key_value_heads", 3, "multiple of num_key_value_heads"),
    ("head_dim", 15, "odd"),
    ("max_position_embeddings", -1, ">= 1"),
    ("max_position_embeddings", 0, ">= 1"),
    ("max_position_embeddings", 2**32, "2\\*\\*26 positions"),
    ("max_position_embeddings", MAX_POSITIONS + 1, "at most 67108864"),
    ("rope_scaling", "llama3", "an object or null"),
    ("rope_scaling", [8.0], "an object or null"),
    ("rope_parameters", 5, "an object or null"),
    ("architectures", "LlamaForCausalLM", "a list of names"),
    ("attention_bias", "false", "true or false"),
    ("bos_token_id", -1, ">= 0"),
    ("bos_token_id", 512, "below vocab_size \\(512\\)"),
    ("eos_token_id", [2, "x"], "an integer"),
    ("eos_token_id", 10**12, "below vocab_size \\(512\\)"),  # issue 33 item 9
    ("eos_token_id", [2, 512], "below vocab_size"),
]


def hf_config(key: str, value: Any) -> dict[str, Any]:
    cfg = dict(BASE_CONFIG)
    if value is DROP:
        cfg.pop(key)
    else:
        cfg[key] = value
    return cfg


@pytest.mark.parametrize(("key", "value", "says"), HF_BAD, ids=[f"{k}={v!r}" for k, v, _ in HF_BAD])
def test_bad_hf_value_names_key_and_file(tmp_path: Path, key: str, value: Any, says: str) -> None:
    (tmp_path / "config.json").write_text(json.dumps(hf_config(key, value)))
    with pytest.raises(ValueError, match=r"config\.json: ") as e:
        ModelConfig.from_hf_dir(tmp_path)
    message = str(e.value)
    assert key in message and re.search(says, message), message


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("rope_scaling.factor", math.nan, "finite"),
        ("rope_scaling.low_freq_factor", -1.0, "finite number > 0"),
        ("rope_scaling.original_max_position_embeddings", 2.5, "an integer"),
        ("rope_scaling.factor", DROP, "lacks 'factor'"),
    ],
)
def test_bad_llama3_rope_scaling(key: str, value: Any, says: str) -> None:
    scaling = dict(BASE_CONFIG["rope_scaling"])
    field = key.split(".")[1]
    if value is DROP:
        scaling.pop(field)
    else:
        scaling[field] = value
    with pytest.raises(ValueError, match=says) as e:
        ModelConfig.from_hf_dict({**BASE_CONFIG, "rope_scaling": scaling}, source="c.json")
    assert str(e.value).startswith("c.json: ") and key.split(".")[1] in str(e.value)


def test_good_hf_values_are_read_exactly() -> None:
    cfg = {**BASE_CONFIG, "hidden_size": 64.0, "max_position_embeddings": MAX_POSITIONS}
    cfg["architectures"] = None  # absent: model_type decides
    c = ModelConfig.from_hf_dict(cfg)
    assert c.hidden_size == 64 and isinstance(c.hidden_size, int)
    assert c.head_dim == 16 and c.max_position_embeddings == MAX_POSITIONS
    assert c.rope_theta == 500000.0 and c.tie_word_embeddings is False
    assert c.rope_scaling is not None and c.rope_scaling.factor == 8.0


def test_head_dim_must_divide_when_implied() -> None:
    with pytest.raises(
        ValueError, match="hidden_size 66 is not divisible by num_attention_heads 4"
    ):
        ModelConfig.from_hf_dict({**BASE_CONFIG, "hidden_size": 66})
    # explicit head_dim: hidden_size need not be heads x head_dim (as in transformers)
    assert ModelConfig.from_hf_dict({**BASE_CONFIG, "hidden_size": 66, "head_dim": 16}).q_size == 64


def test_config_json_that_is_not_an_object(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="config.json: the config is a list"):
        ModelConfig.from_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ValueError, match="config.json: not valid JSON"):
        ModelConfig.from_hf_dir(tmp_path)


GGUF_BAD: list[tuple[str, Any, str]] = [
    ("llama.rope.freq_base", math.nan, "finite number > 0"),
    ("llama.rope.freq_base", 0.0, "finite number > 0"),
    ("llama.rope.freq_base", -1.0, "finite number > 0"),
    ("llama.rope.freq_base", math.inf, "finite number > 0"),
    ("llama.attention.layer_norm_rms_epsilon", math.nan, "finite number >= 0"),
    ("llama.attention.layer_norm_rms_epsilon", -1e-6, "finite number >= 0"),
    ("llama.attention.head_count", 0, ">= 1"),
    ("llama.attention.head_count", [4, 4], "an integer"),
    ("llama.attention.head_count_kv", 0, ">= 1"),
    ("llama.attention.head_count_kv", 3, "must be a multiple of"),
    ("llama.embedding_length", DROP, "lacks required key"),
    ("llama.embedding_length", "64", "an integer"),
    ("llama.block_count", 0, ">= 1"),
    ("llama.context_length", 0, ">= 1"),
    ("llama.context_length", 2**32 - 1, "2\\*\\*26 positions"),
    ("llama.attention.key_length", 15, "odd"),
    ("llama.attention.value_length", 32, "equal K/V head sizes"),
    ("llama.rope.dimension_count", 8, "full RoPE"),
    ("llama.vocab_size", 0, ">= 1"),
    ("llama.rope.scaling.factor", math.nan, "finite number > 0"),
    ("tokenizer.ggml.bos_token_id", "1", "an integer"),
]


@pytest.mark.parametrize(
    ("key", "value", "says"), GGUF_BAD, ids=[f"{k}={v!r}" for k, v, _ in GGUF_BAD]
)
def test_bad_gguf_value_names_key_and_file(key: str, value: Any, says: str) -> None:
    md = dict(GGUF_BASE)
    if value is DROP:
        md.pop(key)
    else:
        md[key] = value
    with pytest.raises(ValueError, match=r"^m\.gguf: ") as e:
        ModelConfig.from_gguf_metadata(md, source="m.gguf")
    message = str(e.value)
    assert key in message and re.search(says, message), message


def test_gguf_vocab_size_comes_from_the_tokens() -> None:
    md = {k: v for k, v in GGUF_BASE.items() if k != "llama.vocab_size"}
    assert (
        ModelConfig.from_gguf_metadata({**md, "tokenizer.ggml.tokens": ["a", "b"]}).vocab_size == 2
    )
    with pytest.raises(ValueError, match="neither 'llama.vocab_size' nor 'tokenizer.ggml.tokens'"):
        ModelConfig.from_gguf_metadata(md)
    with pytest.raises(ValueError, match="tokenizer.ggml.tokens is 'ab', expected"):
        ModelConfig.from_gguf_metadata({**md, "tokenizer.ggml.tokens": "ab"})


def test_constructor_checks_its_fields() -> None:
    good = ModelConfig.from_hf_dict(BASE_CONFIG)
    fields = {f: getattr(good, f) for f in good.__dataclass_fields__}
    for key, value in [
        ("rope_theta", math.nan),
        ("tie_word_embeddings", "no"),
        ("hidden_size", None),
        ("max_position_embeddings", 2**32),
        ("num_key_value_heads", 3),
        ("bos_token_id", 512),
        ("eos_token_ids", (2, 10**12)),
    ]:
        with pytest.raises(ValueError, match="model config: "):
            ModelConfig(**{**fields, key: value})


def test_token_ids_past_the_vocabulary(tmp_path: Path) -> None:
    """issue 33 item 9: an EOS id of 10**12 was accepted (a -1 was not). In config.json
    and generation_config.json it is an error naming the file; a GGUF's is dropped, as
    llama.cpp drops it."""
    (tmp_path / "config.json").write_text(json.dumps(BASE_CONFIG))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 10**12]}))
    with pytest.raises(ValueError, match=r"config\.json: generation_config eos_token_id is 1000"):
        ModelConfig.from_hf_dir(tmp_path)
    cfg = {k: v for k, v in BASE_CONFIG.items() if k != "bos_token_id"}
    with pytest.raises(ValueError, match="generation_config bos_token_id is 512, expected a token"):
        ModelConfig.from_hf_dict(cfg, {"bos_token_id": 512})
    md = {**GGUF_BASE, "tokenizer.ggml.eos_token_id": 10**12, "tokenizer.ggml.eot_token_id": 2}
    c = ModelConfig.from_gguf_metadata({**md, "tokenizer.ggml.bos_token_id": 512})
    assert c.eos_token_ids == (2,) and c.bos_token_id is None
