"""The engine: continuous batching, sampling, forks, beam search, preemption."""

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.errors import (
    EngineDeadError,
    RequestFailedError,
    RequestRejectedError,
    RequestTooLongError,
)
from pagedkv.engine.llm_engine import EngineStats, LLMEngine, TokenizedPrompt

__all__ = ["EngineConfig", "EngineDeadError", "EngineStats", "LLMEngine", "RequestFailedError",
           "RequestRejectedError", "RequestTooLongError", "TokenizedPrompt"]
