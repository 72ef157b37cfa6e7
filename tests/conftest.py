"""Shared test set-up.

Hypothesis: the default run uses the "ci" profile, derandomized (a fixed
seed per test, no example database), so a test that passes once passes on
every clone and every run. The random search belongs in tests marked `slow`,
which load the "search" profile by name (or run everything with
`HYPOTHESIS_PROFILE=search pytest ...`). Every input a search ever found
failing is kept as an explicit `@example` beside its test.

Without a GPU, TRITON_INTERPRET must be set before triton is first imported
in the process, so that the Triton kernels run on the CPU in CI (see
tests/test_triton_ops.py). On a GPU machine the kernels are compiled.
"""

import os
import sys
from pathlib import Path

import torch  # importing torch does not import triton

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).parent))

import pytest  # noqa: E402

try:  # the GPU machine may lack hypothesis; its GPU tests do not use it
    from hypothesis import HealthCheck, settings
except ImportError:
    settings = None
if settings is not None:
    settings.register_profile(
        "ci",
        derandomize=True,
        database=None,
        deadline=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow],
    )
    settings.register_profile("search", deadline=None, suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="module", autouse=True)
def _no_engine_loop_outlives_its_module():
    """Every test module stops the engine loops it started (a server's engine
    thread above all): one left running keeps stepping, and keeps the process's
    collector frozen (`utils.gc_frozen`), under every later module's tests."""
    yield
    from pagedllm import utils

    assert utils._gc_depth == 0, "an engine loop started in this module still runs"


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from pagedllm.resolve import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path):
    """transformers' own reading of the same GGUF file: the oracle (~25 s, once)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        smollm2_path.parent, gguf_file=smollm2_path.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """Our model from the GGUF, float32 on the CPU (loaded once per session)."""
    from pagedllm.model import load_model

    return load_model(smollm2_path, device="cpu", dtype="float32")
