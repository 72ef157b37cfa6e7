"""Issue 33, items 12-20: the house in order (the CLI's modules, the Makefile,
the packaging metadata, scripts/, and the messages a user meets first).

Each test names the item it shows. The import graph is read with the same
`ast` walker as tests/test_import_graph.py.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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


# ------------------------------------------------------------------ item 15
def test_a_header_one_byte_short_says_1_byte(tmp_path: Path) -> None:
    """The header reader's messages agree in number: "needs 1 byte", not "1 bytes"."""
    import struct

    from pagedllm.gguf_metadata import BOOL, read_gguf_metadata

    key = b"a"
    header = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
    path = tmp_path / "short.gguf"
    path.write_bytes(header + struct.pack("<I", BOOL))  # the bool's one byte is missing
    with pytest.raises(ValueError, match="needs 1 byte at offset") as e:
        read_gguf_metadata(path)
    assert "1 bytes" not in str(e.value)


# ------------------------------------------------------------------ item 17
def test_a_worker_that_died_silently_is_named_with_its_likely_cause() -> None:
    from pagedllm.runner.tp_workers import worker_exit_message

    said = worker_exit_message(1, 1, "Traceback ...\nValueError: bad shard", "/x/run.py")
    assert said == "tensor-parallel worker rank 1 exited with code 1: Traceback ...\n" + (
        "ValueError: bad shard"
    )
    guard = worker_exit_message(1, 1, None, "/x/run.py")
    assert guard.startswith("tensor-parallel worker rank 1 exited with code 1 before it started")
    assert '/x/run.py builds the LLM without an `if __name__ == "__main__":` guard' in guard
    assert "spawn" in guard
    killed = worker_exit_message(2, -9, None, "/x/run.py")
    assert killed.startswith("tensor-parallel worker rank 2 exited with code -9: killed by SIGKILL")
    assert "out-of-memory" in killed
    assert "killed by SIGTERM" in worker_exit_message(1, -15, None, None)
    # No main module file (python -c, a notebook): spawn runs nothing again, so no guard.
    assert "guard" not in worker_exit_message(1, 1, None, None)


NO_GUARD = """\
import sys
from pagedllm import LLM
LLM(model=sys.argv[1], device="cpu", dtype="float32", tensor_parallel_size=2, kv_cache_mib=1)
print("built")
"""


@pytest.mark.slow  # two processes load torch and the model: ~5 s
def test_a_script_without_the_main_guard_is_told_so(tmp_path: Path) -> None:
    """The script of item 17: tensor_parallel_size=2 at module level, no guard."""
    from tiny_models import make_tiny_llama_dir

    model, _ = make_tiny_llama_dir(tmp_path / "m", seed=3, num_key_value_heads=2)
    script = tmp_path / "no_guard.py"
    script.write_text(NO_GUARD)
    run = subprocess.run(
        [sys.executable, str(script), str(model)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert run.returncode == 1 and "built" not in run.stdout
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("pagedllm: tensor-parallel worker rank 1 exited with code 1")
    assert f'{script} builds the LLM without an `if __name__ == "__main__":` guard' in last


# ------------------------------------------------------------------ item 13
needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="no make here")


def test_the_makefile_ends_with_a_newline() -> None:
    assert (ROOT / "Makefile").read_bytes().endswith(b"\n")


def _make(*args: str) -> str:
    run = subprocess.run(
        ["make", "--no-print-directory", *args], cwd=ROOT, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    return run.stdout


def _fake_python(path: Path) -> Path:
    """An executable that says it ran and with what: which interpreter make picks."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'#!/bin/sh\necho "ran {path} $*"\n')
    path.chmod(0o755)
    return path


@needs_make
def test_make_test_gpu_takes_the_venvs_python_and_says_so(tmp_path: Path) -> None:
    venv_python = _fake_python(tmp_path / "venv" / "bin" / "python")
    system = _fake_python(tmp_path / "system" / "python3")
    out = _make("-s", "test-gpu", f"VENV={tmp_path / 'venv'}", f"PY={system}")
    assert f"with {venv_python} (the venv's)" in out
    assert f"ran {venv_python} -m pytest -q -m gpu" in out and str(system) not in out
    # No venv (the GPU machine): the system's python on src/, as its scripts run it.
    out = _make("-s", "test-gpu", f"VENV={tmp_path / 'none'}", f"PY={system}")
    assert f"ran {system} -m pytest -q -m gpu" in out and "PYTHONPATH=src" in out


@needs_make
def test_make_setup_and_bench_say_each_step(tmp_path: Path) -> None:
    """`make -n` lists the recipes: every step that installs has its "==>" line."""
    venv = tmp_path / "venv"
    steps = [line for line in _make("-n", "-B", "setup", f"VENV={venv}").splitlines()]
    said = " ".join(line for line in steps if line.lstrip().startswith('echo "==>'))
    for step in ("creating", "CPU build of torch", "GPU found", "installing pagedllm"):
        assert step in said, step
    assert "default model" in said and "is ready" in said
    installs = [line for line in steps if "pip install" in line and "echo" not in line]
    assert len(installs) >= 4 and all(" -q " in line for line in installs)  # quiet pip
    bench = _make("-n", "bench", f"VENV={venv}")
    assert '"==> 1 of 2: pagedllm bench latency' in bench and '"==> 2 of 2:' in bench


def test_the_license_is_an_spdx_expression_without_a_warning() -> None:
    """setuptools deprecates `license = { text = ... }` and warned about it on every install."""
    import warnings

    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    dist = Distribution()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_configuration(dist, ROOT / "pyproject.toml")
    assert [str(w.message) for w in caught if "license" in str(w.message).lower()] == []
    assert dist.metadata.license_expression == "Apache-2.0"


# ------------------------------------------------------------------ item 19
SCRIPTS = ROOT / "scripts"


def test_every_script_is_described_in_the_scripts_readme() -> None:
    readme = (SCRIPTS / "README.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `([\w.-]+)` \|", readme, flags=re.M)
    present = {p.name for p in SCRIPTS.iterdir() if p.is_file() and p.suffix in (".py", ".sh")}
    assert len(rows) == len(set(rows))
    assert sorted(present - set(rows)) == []  # each script says what it is for
    assert not any(re.search(r"issue\d", name) for name in present)  # named for its use


def test_every_script_a_document_names_exists() -> None:
    """docs/, the READMEs, CONTRIBUTING.md, src/, tests/ and the scripts themselves:
    each `scripts/NAME` they give (to rerun a figure) is there."""
    texts = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for folder in ("src", "tests", "scripts"):
        texts += sorted(p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".sh"))
    missing = set()
    for path in texts:
        for name in re.findall(r"scripts/([\w-]+\.(?:py|sh))\b", path.read_text(encoding="utf-8")):
            if not (SCRIPTS / name).is_file():
                missing.add(f"{path.relative_to(ROOT)}: scripts/{name}")
    assert sorted(missing) == []
