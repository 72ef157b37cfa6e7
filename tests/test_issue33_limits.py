"""Sizes checked against the machine before anything is allocated (issue 33, items 10, 11).

Item 10: `--threads` / `LLM(threads=N)` above the usable cores hung (5,000),
failed in libgomp (20,000) or crashed the process (100,000); now one line, before
the model loads, saying how many cores there are. Item 11: dummy weights of a
config with 10**6 layers, or `--kv-cache-mib 1000000` on the CPU, allocated until
the machine ran out; now the planned bytes are checked against the memory
available first, and the error says what would fit.
"""

from __future__ import annotations

import json
import os
import resource

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


# ------------------------------------------------------------------ item 11: memory
def tiny_config(**overrides):
    from pagedllm.config import ModelConfig
    from tiny_models import BASE_CONFIG

    return ModelConfig.from_hf_dict({**BASE_CONFIG, **overrides})


@pytest.fixture
def gib_available(monkeypatch):
    """The machine has 1 GiB available (MemAvailable), whatever this one has."""
    from pagedllm import memory

    monkeypatch.setattr(memory, "available_bytes", lambda device: (1 << 30, "MemAvailable"))
    return 1 << 30


def test_dummy_weights_past_the_memory_are_refused_before_allocating(gib_available) -> None:
    import dataclasses

    import torch

    from pagedllm.model import dummy_model
    from pagedllm.model.loader import dummy_weight_bytes

    config = tiny_config(num_hidden_layers=10**6)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ValueError) as e:
        dummy_model(config, "cpu", "float32", source="m/config.json")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 * 1024  # KiB
    message = str(e.value)
    assert message.startswith("m/config.json: dummy weights of 1,000,000 layers")
    assert "more than 90% of the 1.0 GiB available (MemAvailable)" in message
    assert "\n" not in message and "lower num_hidden_layers" in message
    # What it says fits does, and one layer more does not.
    fits = int(message.split("at most ")[1].split(" layers")[0].replace(",", ""))
    usable = int(gib_available * 0.9)
    at = dataclasses.replace(config, num_hidden_layers=fits)
    assert dummy_weight_bytes(at, torch.float32, "cpu") <= usable
    over = dataclasses.replace(config, num_hidden_layers=fits + 1)
    assert dummy_weight_bytes(over, torch.float32, "cpu") > usable
    assert dummy_model(tiny_config(), "cpu", "float32") is not None  # a small one still loads


def test_dummy_weights_say_when_not_one_layer_fits(gib_available) -> None:
    from pagedllm.model import dummy_model

    with pytest.raises(ValueError, match="not one layer of this shape fits: lower hidden_size"):
        dummy_model(tiny_config(vocab_size=2**22, hidden_size=64), "cpu", "bfloat16")


def test_dummy_weights_past_any_machine_fail_through_the_cli(tmp_path, capsys) -> None:
    """The real MemAvailable: 10**9 layers (130 TB) fit on no machine."""
    from tiny_models import BASE_CONFIG

    (tmp_path / "config.json").write_text(json.dumps({**BASE_CONFIG, "num_hidden_layers": 10**9}))
    argv = ["--model", str(tmp_path), "--load-format", "dummy", "--device", "cpu", "hi", "2"]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"error: {tmp_path / 'config.json'}: dummy weights of 1,000,000,000 layers" in err


def test_a_kv_cache_past_the_memory_is_refused_before_allocating(gib_available) -> None:
    from pagedllm.model import dummy_model
    from pagedllm.runner.model_runner import MiB, plan_kv_cache

    model = dummy_model(tiny_config(), "cpu", "float32")
    # 256 bytes a token: 2**20 tokens of 4,096 sequences is 1 TiB, past 1 GiB.
    with pytest.raises(ValueError) as e:
        plan_kv_cache(model, 16, 1_000_000, 1 << 20, 4096)
    message = str(e.value)
    assert message.startswith("the KV cache sized by --kv-cache-mib 1000000 takes 976.6 GiB, ")
    assert "more than 90% of the 1.0 GiB available (MemAvailable)" in message
    assert message.endswith("set --kv-cache-mib (kv_cache_mib) to 921 or less")
    spec, _ = plan_kv_cache(model, 16, 921, 1 << 20, 4096)  # and that fits
    assert spec.mib <= 921 and spec.num_blocks * 16 * 256 == 921 * MiB
    # The ranks of a CPU engine share the machine: two halve what each may take.
    with pytest.raises(
        ValueError, match="takes 921.0 MiB for each of 2 ranks, together 1.8 GiB, more"
    ):
        plan_kv_cache(model, 16, 921, 1 << 20, 4096, ranks=2)
    # The cache is the planned pages, not the flag: a large budget that few
    # sequences could use is no error.
    assert plan_kv_cache(model, 16, 1_000_000, 1024, 4)[0].num_blocks == 64 * 4


def test_a_kv_cache_past_the_memory_fails_through_the_cli_and_llm(tmp_path, capsys) -> None:
    """The real MemAvailable: a 16 TiB cache fits on no machine."""
    from pagedllm import LLM
    from tiny_models import BASE_CONFIG

    (tmp_path / "config.json").write_text(
        json.dumps({**BASE_CONFIG, "max_position_embeddings": 1 << 20})
    )
    flags = ["--model", str(tmp_path), "--load-format", "dummy", "--device", "cpu"]
    flags += ["--kv-cache-mib", "1e9", "--max-num-seqs", "65535"]
    flags += ["--max-num-batched-tokens", "65535", "--max-model-len", str(1 << 20)]
    assert cli.main([*flags, "hi", "2"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "error: the KV cache sized by --kv-cache-mib 1000000000 takes 16,383.8 GiB, more" in err
    assert "set --kv-cache-mib (kv_cache_mib) to" in err
    with pytest.raises(ValueError, match="the KV cache sized by --kv-cache-mib 1000000000"):
        LLM(
            model=str(tmp_path),
            load_format="dummy",
            device="cpu",
            kv_cache_mib=1e9,
            max_num_seqs=65535,
            max_num_batched_tokens=65535,
            max_model_len=1 << 20,
        )


def test_available_memory_is_read_from_the_machine() -> None:
    from pagedllm import memory

    available, where = memory.available_bytes("cpu")
    assert where in ("MemAvailable", "the memory cgroup's limit less its usage")
    assert 0 < available
    assert available <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _cgroup_files(folder, **files) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name.replace("__", ".")).write_text(text)


def test_a_memory_cgroup_limit_caps_what_is_available(tmp_path, monkeypatch) -> None:
    """A container's limit (cgroup v2 memory.max, or v1 limit_in_bytes) less its
    usage, the droppable page cache (inactive_file) not counted as used, is what
    the CPU has when it is below MemAvailable; "max" or v1's 2**63 is no limit."""
    from pagedllm import memory

    v2 = tmp_path / "v2"
    _cgroup_files(
        v2,
        memory__max=str(3 << 30),
        memory__current=str(2 << 30),
        memory__stat=f"anon 1\ninactive_file {1 << 29}\nactive_file 7\n",
    )
    assert memory.cgroup_room(str(v2)) == (3 << 30) - (2 << 30) + (1 << 29)
    monkeypatch.setattr(memory, "CGROUP_ROOT", str(v2))
    monkeypatch.setattr(memory, "available_cpu_bytes", lambda: 64 << 30)
    assert memory.available_bytes("cpu") == (
        (3 << 30) - (3 << 29),
        "the memory cgroup's limit less its usage",
    )
    (v2 / "memory.max").write_text("max\n")
    assert memory.cgroup_room(str(v2)) is None
    assert memory.available_bytes("cpu") == (64 << 30, "MemAvailable")

    v1 = tmp_path / "v1"
    _cgroup_files(
        v1 / "memory",
        memory__limit_in_bytes=str(1 << 30),
        memory__usage_in_bytes=str(1 << 29),
        memory__stat=f"inactive_file 5\ntotal_inactive_file {1 << 28}\n",
    )
    assert memory.cgroup_room(str(v1)) == (1 << 30) - (1 << 28)
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert memory.cgroup_room(str(v1)) is None
    assert memory.cgroup_room(str(tmp_path / "none")) is None  # no cgroup files at all
    # Over its limit already (usage above it): nothing is left, never a negative.
    _cgroup_files(v2, memory__max=str(1 << 20), memory__current=str(1 << 30))
    (v2 / "memory.stat").unlink()
    assert memory.cgroup_room(str(v2)) == 0
