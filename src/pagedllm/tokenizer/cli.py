"""`pagedllm tokenize` and `pagedllm detokenize`: look at ids and pieces by hand.

Owns: the two subcommand functions (argument parsing and printing). Does not
own: the main CLI dispatcher (`pagedllm/cli.py` wires these in) or any
tokenization logic.

    pagedllm tokenize "Hello, world!"                    # default model's tokenizer
    pagedllm tokenize --model path/to/model.gguf --special "<|im_start|>hi"
    pagedllm detokenize 9906 11 1917 0 --tokenizer path/to/tokenizer.json

Both return a process exit code, in the style of every `pagedllm` command
(see `pagedllm/cli.py`): 0 on success; 2 for a usage error, such as an id that
is not a whole number >= 0 (argparse's code and its `PROG: error:` line); 1 when
the run fails, such as a tokenizer that cannot be loaded or an id outside its
vocabulary, printed as one line `pagedllm tokenize: error: MESSAGE`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from pagedllm.tokenizer.tokenizer import Tokenizer
from pagedllm.utils import plural


def _add_source_args(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group()
    src.add_argument(
        "--model",
        metavar="PATH",
        help="HF model directory or .gguf file (default: the default model, SmolLM2-135M-Instruct)",
    )
    src.add_argument("--tokenizer", metavar="PATH", help="a tokenizer.json file")


def _load(args: argparse.Namespace) -> Tokenizer:
    if args.tokenizer is not None:
        return Tokenizer.from_file(args.tokenizer)
    return Tokenizer.from_model_path(args.model)


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace | int:
    try:
        return parser.parse_args(list(argv))
    except SystemExit as e:  # --help (0) or a usage error (2): report, don't exit
        return int(e.code or 0)


def _usage_error(parser: argparse.ArgumentParser, message: object) -> int:
    """A bad argument found after parsing: argparse's usage line and message; exit code 2."""
    try:
        parser.error(str(message))
    except SystemExit as e:
        return int(e.code or 2)
    return 2


def _error(parser: argparse.ArgumentParser, message: object) -> int:
    """A failed run: `PROG: error: MESSAGE` on one line of stderr; exit code 1."""
    text = " ".join(line.strip() for line in str(message).splitlines() if line.strip())
    print(f"{parser.prog}: error: {text}", file=sys.stderr)
    return 1


def _piece(tok: Tokenizer, token_id: int) -> str:
    """How one token reads: its text, or its bytes when it is part of a character."""
    data = tok.token_bytes(token_id)
    try:
        return repr(data.decode("utf-8"))
    except UnicodeDecodeError:
        return repr(data)


def tokenize_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="pagedllm tokenize", description="Print the token ids and pieces of TEXT."
    )
    parser.add_argument("text", metavar="TEXT", help='the text to tokenize ("-" reads stdin)')
    _add_source_args(parser)
    parser.add_argument(
        "--special",
        action="store_true",
        help="match special-token strings such as <|eot_id|> as those tokens",
    )
    parser.add_argument(
        "--add-special-tokens",
        action="store_true",
        help="add what the model puts around a prompt (BOS for Llama 3)",
    )
    parser.add_argument("--json", action="store_true", help="print only a JSON list of ids")
    args = _parse(parser, argv)
    if isinstance(args, int):
        return args
    text = sys.stdin.read() if args.text == "-" else args.text  # exactly as given
    try:
        tok = _load(args)
    except (OSError, ValueError) as e:
        return _error(parser, e)
    ids = tok.encode(text, args.add_special_tokens, allow_special=args.special)
    if args.json:
        print(json.dumps(ids))
        return 0
    print(f"{plural(len(ids), 'token')}: {' '.join(map(str, ids))}")
    width = len(str(max(ids))) if ids else 1
    for token_id in ids:
        special = "  (special)" if token_id in tok.special_token_ids else ""
        print(
            f"{token_id:>{width}}  {tok.id_to_token(token_id)!s:<16} {_piece(tok, token_id)}{special}"
        )
    return 0


def _parse_ids(values: Sequence[str]) -> list[int]:
    """Accept "1 2 3", "1,2,3" and "[1, 2, 3]" (what `tokenize --json` prints).

    Raises ValueError naming the first part that is not a whole number >= 0.
    """
    ids = []
    for value in values:
        for part in value.replace("[", " ").replace("]", " ").replace(",", " ").split():
            if not part.isascii() or not part.isdigit():
                raise ValueError(f"token ids must be whole numbers >= 0, got {part!r}")
            ids.append(int(part))
    return ids


def detokenize_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="pagedllm detokenize", description="Print the text of token ids."
    )
    parser.add_argument("ids", metavar="ID", nargs="+", help="token ids (spaces or commas)")
    _add_source_args(parser)
    parser.add_argument(
        "--skip-special-tokens", action="store_true", help="leave control tokens out of the text"
    )
    args = _parse(parser, argv)
    if isinstance(args, int):
        return args
    try:
        ids = _parse_ids(args.ids)
    except ValueError as e:
        return _usage_error(parser, e)
    try:
        tok = _load(args)
        text = tok.decode(ids, skip_special_tokens=args.skip_special_tokens)
    except (OSError, ValueError) as e:
        return _error(parser, e)
    print(text)
    return 0
