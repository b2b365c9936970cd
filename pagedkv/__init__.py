"""pagedkv: an LLM inference and serving engine built around paged KV-cache memory."""

from pagedkv.lora.request import LoRARequest
from pagedkv.outputs import CompletionOutput, RequestOutput
from pagedkv.sampling_params import SamplingParams, StructuredOutput

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "LoRARequest", "RequestOutput", "SamplingParams", "StructuredOutput",
           "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch and the models; load it only when asked for, so that
    # `import pagedkv.memory` (the pure-Python core) stays light.
    if name == "LLM":
        from pagedkv.llm import LLM
        return LLM
    raise AttributeError(f"module 'pagedkv' has no attribute {name!r}")
