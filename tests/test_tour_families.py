"""Tour chapter 18 ("One engine, five families") says what the code does.

The chapter quotes the lines of `model/llama.py` that each family switch
guards, tabulates the switches of `ModelConfig`, and computes how much K/V a
windowed model would keep if pages outside the windows were freed. These
tests hold it to the code: a quote must still be in the file, verbatim; the
table must have a row for every switch (a new one must be added to it); and
the shares it quotes must be what the configs give. test_tour.py runs its
commands.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from pagedllm.config import ModelConfig

ROOT = Path(__file__).resolve().parents[1]
CHAPTER = ROOT / "docs" / "tour" / "18-families.md"
QUOTE_HEADER = "# src/pagedllm/model/llama.py"


def chapter() -> str:
    return CHAPTER.read_text(encoding="utf-8")


def quoted_blocks() -> list[list[str]]:
    """The chapter's python blocks that quote llama.py (first line: QUOTE_HEADER)."""
    blocks = []
    for block in re.findall(r"```python\n(.*?)```", chapter(), flags=re.S):
        lines = block.rstrip("\n").split("\n")
        if lines[0].startswith(QUOTE_HEADER):
            blocks.append(lines[1:])
    return blocks


def found_verbatim(quote: list[str], source: list[str]) -> bool:
    """Whether `quote` is a run of consecutive lines of `source`, all shifted right by
    one same indent (a quote drops the indent of its first line, nothing else)."""
    for start in range(len(source) - len(quote) + 1):
        first = source[start]
        if not first.endswith(quote[0]):
            continue
        indent = first[: len(first) - len(quote[0])]
        if indent.strip() == "" and all(
            source[start + k] == (indent + line if line else "") for k, line in enumerate(quote)
        ):
            return True
    return False


def test_the_chapter_quotes_llama_py_verbatim():
    source = (ROOT / "src" / "pagedllm" / "model" / "llama.py").read_text().split("\n")
    blocks = quoted_blocks()
    assert len(blocks) >= 8  # one quote or more per switch that the model reads
    stale = [b for b in blocks if not found_verbatim(b, source)]
    assert not stale, "chapter 18 quotes lines that model/llama.py no longer has:\n" + "\n\n".join(
        "\n".join(b) for b in stale
    )


def test_a_quote_that_is_not_in_the_file_is_found_stale():
    source = ["    if x:", "        y = 1", "", "    z = 2"]
    assert found_verbatim(["if x:", "    y = 1"], source)
    assert found_verbatim(["y = 1", "", "z = 2"], source[1:]) is False  # relative indent differs
    assert not found_verbatim(["if x:", "    y = 2"], source)
    assert not found_verbatim(["if x:", "y = 1"], source)


def test_the_table_has_a_row_for_every_switch():
    fields = [f.name for f in dataclasses.fields(ModelConfig)]
    # The fields after it are per family, but for the checkpoint's quantization (issue 36).
    switches = [f for f in fields[fields.index("family") :] if f != "quantization"]
    rows = re.findall(r"^\| `(\w+)`", chapter(), flags=re.M)
    assert set(switches) <= set(rows), (
        f"switches missing from the table: {set(switches) - set(rows)}"
    )
    assert set(rows) <= set(fields), (
        f"rows that are no ModelConfig field: {set(rows) - set(fields)}"
    )


def kept_share(config: ModelConfig, context: int) -> float:
    """The share of a sequence's K/V that its layers' windows cover (1.0: no windows)."""
    return sum(
        min(config.window(i) or context, context) for i in range(config.num_hidden_layers)
    ) / (config.num_hidden_layers * context)


def gemma3_270m_config() -> ModelConfig:
    """The Gemma 3 270M GGUF's config, from the header keys that shape it."""
    md = {
        "general.architecture": "gemma3",
        "gemma3.context_length": 32768,
        "gemma3.embedding_length": 640,
        "gemma3.block_count": 18,
        "gemma3.feed_forward_length": 2048,
        "gemma3.attention.head_count": 4,
        "gemma3.attention.head_count_kv": 1,
        "gemma3.attention.key_length": 256,
        "gemma3.attention.value_length": 256,
        "gemma3.rope.freq_base": 1e6,
        "gemma3.attention.sliding_window": 512,
        "gemma3.vocab_size": 262144,
    }
    return ModelConfig.from_gguf_metadata(md)


@pytest.mark.parametrize(
    ("config", "quoted"),
    [
        (gemma3_270m_config, "18.0 % in all"),
        (lambda: ModelConfig.from_hf_dir(_preset("gemma-3-1b")), "851,968 = 16.7 %"),
    ],
)
def test_the_window_shares_it_quotes(config, quoted):
    share = kept_share(config(), 32768)
    assert f"{share:.1%}".replace("%", " %") in quoted
    assert quoted in chapter()


def test_the_270m_sizes_it_quotes():
    c = gemma3_270m_config()
    assert [i for i in range(18) if c.window(i) == 0] == [5, 11, 17]
    per_token = c.kv_bytes_per_token(2)  # bf16, every layer
    assert per_token * 32768 == 576 * 2**20
    assert kept_share(c, 32768) * per_token * 32768 / 2**20 == pytest.approx(103.5)
    assert "576 MiB a sequence today against 103.5" in chapter().replace("\n", " ")


def _preset(name: str) -> Path:
    from pagedllm.presets import preset_dir

    return preset_dir(name)
