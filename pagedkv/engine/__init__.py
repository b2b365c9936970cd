"""The engine: continuous batching, sampling, forks, beam search, preemption."""

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.errors import (
    EngineDeadError,
    RequestFailedError,
    RequestRejectedError,
    RequestTooLongError,
)
from pagedkv.engine.input_processor import TokenizedPrompt
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.stats import EngineStats

__all__ = ["EngineConfig", "EngineDeadError", "EngineStats", "LLMEngine", "RequestFailedError",
           "RequestRejectedError", "RequestTooLongError", "TokenizedPrompt"]
