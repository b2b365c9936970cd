"""LoRA adapters: many fine-tunes of one base model served in one batch (docs/lora.md).

    request.py   LoRARequest (vLLM's shape) and LoRAError; pure Python
    adapter.py   a PEFT folder -> LoRAWeights (validated against the base model; digest of the weights)
    layers.py    the transform: LoRALinear around the model's linear layers, adapters in
                 preallocated slots, the low-rank products grouped by adapter per step
    manager.py   the engine's registry of adapters, the idle-adapter cache and slot assignment
"""

from pagedkv.lora.request import LoRAError, LoRARequest

__all__ = ["LoRAError", "LoRARequest"]
