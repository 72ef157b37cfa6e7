"""Encode throughput of our tokenizer beside HF `tokenizers`, on a long mixed text.

Owns: the benchmark (`main`) and `hf_reference`, which builds the HF
`tokenizers.Tokenizer` that our ids must equal (the tests use it too). Does
not own: any tokenization logic.

    python -m pagedllm.bench.tokenizer_bench [--repeat 100] [--model PATH] [--text FILE]

The text is the test corpus (tests/tokenizer_corpus: prose, code, many
scripts, emoji, control characters) repeated `--repeat` times. Three ways of
encoding it, each in MB of UTF-8 per second:
- one string: `encode(text)` on the whole text at once;
- documents: the text cut at blank lines, encoded one after the other;
- HF batch: `encode_batch` on those documents (multi-threaded in Rust).
Ours runs twice: first with an empty pre-token cache ("fresh"), then again
("warm"). Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pagedllm.gguf_metadata import read_gguf_metadata
from pagedllm.model_source import llama3_tokenizer_json
from pagedllm.tokenizer import Tokenizer
from pagedllm.tokenizer.pretokenize import LLAMA3_PATTERN

CORPUS_DIR = Path(__file__).resolve().parents[3] / "tests" / "tokenizer_corpus"


def hf_reference(path: str | Path) -> Any:
    """An HF `tokenizers.Tokenizer` for a tokenizer.json, HF directory or GGUF file.

    For GGUF it is rebuilt from the metadata with the pre-tokenizer that the
    model's own tokenizer.json has (`smollm`: Digits(individual) + ByteLevel,
    as StarCoder's). transformers' GGUF loader is not used as the reference:
    it ignores `tokenizer.ggml.pre` and gives SmolLM2 a plain ByteLevel
    pre-tokenizer, which tokenizes "a  1" differently from the real model.
    """
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if path.suffix.lower() != ".gguf":
        return HFTokenizer.from_file(str(path))
    meta = read_gguf_metadata(path, prefix="tokenizer.")
    pre = meta["tokenizer.ggml.pre"]
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {t: i for i, t in reversed(list(enumerate(tokens)))}
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("llama-bpe", "llama3", "llama-v3"):
        model = models.BPE(vocab=vocab, merges=merges, ignore_merges=True)
        pre_tok = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_PATTERN), "isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif pre in ("smollm", "starcoder"):
        model = models.BPE(vocab=vocab, merges=merges)
        pre_tok = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif pre == "gpt2":
        model = models.BPE(vocab=vocab, merges=merges)
        pre_tok = byte_level
    else:
        raise ValueError(f"no HF reference for tokenizer.ggml.pre {pre!r}")
    hf = HFTokenizer(model)
    hf.pre_tokenizer = pre_tok
    hf.decoder = decoders.ByteLevel()
    hf.add_tokens(
        [
            AddedToken(tokens[i], special=False, normalized=False)
            for i, t in enumerate(types)
            if t == 4
        ]
    )
    hf.add_special_tokens(
        [
            AddedToken(tokens[i], special=True, normalized=False)
            for i, t in enumerate(types)
            if t in (2, 3)
        ]
    )
    return hf


def corpus_text(text_file: str | None = None) -> str:
    if text_file is not None:
        return Path(text_file).read_text(encoding="utf-8")
    files = sorted(CORPUS_DIR.glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no corpus in {CORPUS_DIR}; pass --text FILE")
    return "\n\n".join(f.read_bytes().decode("utf-8") for f in files)


def _mbps(fn: Callable[[], Any], nbytes: int) -> float:
    start = time.perf_counter()
    fn()
    return nbytes / (time.perf_counter() - start) / 1e6


def bench_one(name: str, path: Path, text: str) -> dict[str, Any]:
    docs = [d for d in text.split("\n\n") if d]
    nbytes = len(text.encode("utf-8"))
    docs_bytes = sum(len(d.encode("utf-8")) for d in docs)

    ours = Tokenizer.from_model_path(path)  # fresh pre-token cache
    hf = hf_reference(path)
    row: dict[str, Any] = {"tokenizer": name, "mbytes": round(nbytes / 1e6, 3)}
    row["ours_fresh_string"] = _mbps(lambda: ours.encode(text), nbytes)
    row["ours_warm_string"] = _mbps(lambda: ours.encode(text), nbytes)
    row["ours_warm_docs"] = _mbps(lambda: [ours.encode(d) for d in docs], docs_bytes)
    row["hf_string"] = _mbps(lambda: hf.encode(text, add_special_tokens=False), nbytes)
    row["hf_docs"] = _mbps(
        lambda: [hf.encode(d, add_special_tokens=False) for d in docs], docs_bytes
    )
    row["hf_batch_docs"] = _mbps(
        lambda: hf.encode_batch(docs, add_special_tokens=False), docs_bytes
    )
    same = ours.encode(text) == hf.encode(text, add_special_tokens=False).ids
    row["identical_ids"] = same
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedllm.bench.tokenizer_bench")
    parser.add_argument("--repeat", type=int, default=100, help="corpus copies in the text")
    parser.add_argument("--model", help="HF dir, .gguf or tokenizer.json (default: both built-ins)")
    parser.add_argument("--text", help="a UTF-8 text file instead of the test corpus")
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")

    text = corpus_text(args.text) * args.repeat
    targets: list[tuple[str, Path]] = []
    if args.model is not None:
        targets.append((Path(args.model).name, Path(args.model)))
    else:
        from pagedllm.resolve import default_model_path

        llama3 = llama3_tokenizer_json()
        if llama3 is not None:
            targets.append(("llama3", llama3))
        targets.append(("smollm2", default_model_path()))

    rows = [bench_one(name, path, text) for name, path in targets]
    cols = [
        ("tokenizer", "tokenizer"),
        ("ours_fresh_string", "ours fresh"),
        ("ours_warm_string", "ours warm"),
        ("ours_warm_docs", "ours docs"),
        ("hf_string", "HF string"),
        ("hf_docs", "HF docs"),
        ("hf_batch_docs", "HF batch"),
        ("identical_ids", "same ids"),
    ]
    print(f"encode throughput, MB/s of UTF-8 ({rows[0]['mbytes']} MB of text)")
    print("  ".join(f"{title:>10}" for _, title in cols))
    for row in rows:
        print("  ".join(f"{row[key]!s:>10}" for key, _ in cols))
    print(json.dumps({"bench": "tokenizer_encode", "unit": "MB/s", "results": rows}))
    return 0 if all(r["identical_ids"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
