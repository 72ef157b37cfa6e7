"""The one-line error style and the exit codes that every `pagedllm` command shares.

    pagedllm[ SUB]: error: MESSAGE        (on stderr, on one line)

Owns: `error` (print that line, return the exit code), `one_line` (a message's
lines joined into one) and the EXIT_* codes. Its own module, importing nothing
of pagedllm, so that the subcommands (`bench/`, `inspect_model.py`,
`trace.py`) can use the style without importing `cli.py`, which imports them
back to dispatch to them.

Exit codes:

    0    done
    1    the run failed (EXIT_FAILED)
    2    a usage error: a bad option or argument (EXIT_USAGE, argparse's code)
    130  interrupted by Ctrl-C (EXIT_INTERRUPTED)
    141  stdout was closed early, as a process killed by SIGPIPE reports it
         (EXIT_BROKEN_PIPE)
"""

from __future__ import annotations

import sys

EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_BROKEN_PIPE = 1, 2, 130, 141


def error(prog: str, message: object, code: int = EXIT_FAILED) -> int:
    """Print `PROG: error: MESSAGE` as one line on stderr; return `code`."""
    print(f"{prog}: error: {one_line(message)}", file=sys.stderr)
    return code


def one_line(message: object) -> str:
    """A message on one line: its lines joined by spaces, indentation dropped."""
    return " ".join(part.strip() for part in str(message).splitlines() if part.strip())
