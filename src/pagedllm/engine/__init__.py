"""The engine: the step loop (`LLMEngine`) and the offline API (`LLM`)."""

from pagedllm.engine.llm import LLM, RequestOutput
from pagedllm.engine.llm_engine import EngineConfig, LLMEngine, StepOutput

__all__ = ["LLM", "EngineConfig", "LLMEngine", "RequestOutput", "StepOutput"]
