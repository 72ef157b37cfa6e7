"""The engine: the step loop (`LLMEngine`) and the offline API (`LLM`).

No torch here: `import pagedllm.engine` works without it; building an engine
imports the runner (and torch) then.
"""

from pagedllm.engine.llm import LLM, RequestOutput
from pagedllm.engine.llm_engine import LLMEngine, StepOutput
from pagedllm.engine_config import EngineConfig

__all__ = ["LLM", "EngineConfig", "LLMEngine", "RequestOutput", "StepOutput"]
