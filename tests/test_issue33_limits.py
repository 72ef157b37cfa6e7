"""Sizes checked against the machine before anything is allocated (issue 33, items 10, 11).

Item 10: `--threads` / `LLM(threads=N)` above the usable cores hung (5,000),
failed in libgomp (20,000) or crashed the process (100,000); now one line, before
the model loads, saying how many cores there are. Item 11: dummy weights of a
config with 10**6 layers, or `--kv-cache-mib 1000000` on the CPU, allocated until
the machine ran out; now the planned bytes are checked against the memory
available first, and the error says what would fit.
"""

from __future__ import annotations

import pytest

from pagedllm import cli, cpu_threads
from pagedllm.engine_config import EngineConfig


# ------------------------------------------------------------------ item 10: threads
def test_threads_above_the_cores_are_refused_by_the_config(monkeypatch) -> None:
    monkeypatch.setattr(cpu_threads, "usable_cores", lambda: 4)
    assert EngineConfig(threads=4).threads == 4
    with pytest.raises(ValueError) as e:
        EngineConfig(threads=5000)
    message = str(e.value)
    assert message.startswith("threads must be at most 4, the CPU cores this process may use")
    assert "got 5000" in message and "give 1 to 4" in message and "\n" not in message


@pytest.mark.parametrize("command", [[], ["bench", "latency"], ["serve"]])
@pytest.mark.parametrize("count", ["5000", "20000", "100000"])
def test_threads_flag_above_the_cores_is_a_usage_error(command, count, capsys) -> None:
    """The flag's own check: exit 2 and one line, before any model is read."""
    cores = cpu_threads.usable_cores()
    prompt = [] if command else ["hi"]
    assert cli.main([*command, "--threads", count, *prompt]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "error: argument --threads: must be at most" in err
    assert f"{cores}, the CPU cores this process may use, got {count}; give 1 to {cores}" in err


def test_llm_threads_above_the_cores_fail_before_loading(monkeypatch, tmp_path) -> None:
    """LLM(threads=N) checks before it touches the model (a path that does not exist)."""
    from pagedllm import LLM

    monkeypatch.setattr(cpu_threads, "usable_cores", lambda: 2)
    with pytest.raises(ValueError, match="threads must be at most 2"):
        LLM(model=str(tmp_path / "nothing-here"), threads=100_000)
