"""The engine: continuous batching, sampling, forks, beam search, preemption.

Its configuration, errors, flags and input checks are pure Python; ``LLMEngine`` (which pulls in
torch through the sampler and the runner) is loaded on first use, so the command line builds its
parsers, and the simulator runs, without importing torch.
"""

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.errors import (
    EngineDeadError,
    RequestFailedError,
    RequestRejectedError,
    RequestTooLongError,
)
from pagedkv.engine.input_processor import TokenizedPrompt
from pagedkv.engine.stats import EngineStats
from pagedkv.memory import DEFAULT_TENANT  # the tenant of a request that names none (server labels)

__all__ = ["DEFAULT_TENANT", "EngineConfig", "EngineDeadError", "EngineStats", "LLMEngine", "RequestFailedError",
           "RequestRejectedError", "RequestTooLongError", "TokenizedPrompt"]


def __getattr__(name: str):
    if name == "LLMEngine":
        from pagedkv.engine.llm_engine import LLMEngine
        return LLMEngine
    raise AttributeError(f"module 'pagedkv.engine' has no attribute {name!r}")
