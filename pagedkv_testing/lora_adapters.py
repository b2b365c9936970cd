"""Helpers for the LoRA tests: PEFT adapters with random weights on tiny checkpoints, and their
merged references (PEFT's ``merge_and_unload``: the adapter folded into the base weights).

Imported explicitly (``from pagedkv_testing.lora_adapters import ...``); pytest does not collect it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pagedkv_testing.hf_checkpoints import load_hf_reference


def make_adapter(base_folder: Path, out: Path, *, seed: int, std: float = 0.3, **lora: Any) -> torch.nn.Module:
    """Save a PEFT LoRA adapter of the checkpoint in ``base_folder`` to ``out`` (A and B random:
    PEFT's B starts at zero, which would change nothing) and return the merged reference model."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(load_hf_reference(base_folder), LoraConfig(**lora))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    model.save_pretrained(str(out))
    return model.merge_and_unload().eval()
