"""Issue 33, items 12-20: the house in order (the CLI's modules, the Makefile,
the packaging metadata, scripts/, and the messages a user meets first).

Each test names the item it shows. The import graph is read with the same
`ast` walker as tests/test_import_graph.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from test_import_graph import SRC, cycles, import_graph

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ item 18
def test_the_subcommands_take_the_error_style_from_cli_errors_not_cli() -> None:
    """bench/cli.py, inspect_model.py and trace.py import `error` from cli_errors.py;
    cli.py imports them to dispatch, and no circle through cli.py is left."""
    edges = import_graph(SRC, "pagedllm")
    for module in ("pagedllm.bench.cli", "pagedllm.inspect_model", "pagedllm.trace"):
        assert "pagedllm.cli_errors" in edges[module], module
        assert "pagedllm.cli" not in edges[module], module
    assert edges["pagedllm.cli_errors"] == set()  # imports nothing of pagedllm
    assert [sorted(c) for c in cycles(edges) if "pagedllm.cli" in c] == []


def test_cli_still_offers_the_error_style_it_used_to_define() -> None:
    """Older imports (`from pagedllm.cli import error, one_line, EXIT_*`) keep working."""
    from pagedllm import cli, cli_errors

    assert cli.error is cli_errors.error and cli.one_line is cli_errors.one_line
    assert (cli.EXIT_FAILED, cli.EXIT_USAGE, cli.EXIT_INTERRUPTED, cli.EXIT_BROKEN_PIPE) == (
        1,
        2,
        130,
        141,
    )


def test_a_subcommand_module_loads_without_the_generate_command() -> None:
    code = (
        "import sys, pagedllm.bench.cli, pagedllm.inspect_model, pagedllm.trace; "
        "print('pagedllm.cli' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "False", out.stderr
