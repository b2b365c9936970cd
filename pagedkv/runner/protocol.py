"""What the engine may call on a runner, and read from it: the ``Runner`` protocol.

The engine holds a ``Runner`` and never probes it (no ``getattr``/``hasattr``): every fact it
needs is named here, typed, and implemented by ``ModelRunner`` (one device). A runner that drives
tensor-parallel ranks, or a test double, implements the same members.

    sizes        block_size, num_blocks, num_host_blocks          -> the memory core's pools
    model        config (ModelConfig: vocab, shape for the step-time prior), set_context_length
    KV layout    kv_format, kv_full_blocks, kv_quant_parts, bytes_per_block, kv_groups, payload_bytes,
                 model_dtype, weights_quantization                -> the disk tier's fingerprint
    a step       execute(chunks) -> logits
    block moves  copy_blocks (copy-on-write), swap_out / swap_in (device <-> host),
                 block_payloads / host_block_payloads / load_host_blocks (the disk tier's bytes)
    8-bit KV     write_error (the write kernel's error sums), kv_quant_error()
    LoRA         lora (the slots, None without), set_lora_slot
    shutdown     close (a tensor-parallel runner stops its ranks), on_failure (a rank died meanwhile)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from pagedkv.lora.adapter import LoRAWeights
    from pagedkv.lora.layers import LoRAStack
    from pagedkv.model_shape import KVGroup
    from pagedkv.models.config import ModelConfig
    from pagedkv.ops.kv_format import KVFormat
    from pagedkv.runner.batch import SeqChunk


@runtime_checkable
class Runner(Protocol):
    """A model on a paged KV cache, as the engine sees it (implemented by ``ModelRunner``)."""

    config: ModelConfig        # the model's shape and vocabulary
    lora: LoRAStack | None     # the LoRA slots (built with max_loras > 0), else None
    # 8-bit KV formats: sum((dequantized - x)^2), sum(x^2) per layer and K/V, float64
    # [layers, 2, 2], accumulated by the write kernel (engine/kv_quality.py watches it); else None
    write_error: torch.Tensor | None

    @property
    def block_size(self) -> int: ...

    @property
    def num_blocks(self) -> int:
        """Device KV blocks."""
        ...

    @property
    def num_host_blocks(self) -> int:
        """Host KV blocks (the host tier and swap space; 0: none)."""
        ...

    @property
    def kv_format(self) -> KVFormat:
        """How a block stores K and V (model dtype, or 8-bit with per-block scales)."""
        ...

    @property
    def bytes_per_block(self) -> int:
        """One block's K/V bytes, scales included (device memory per block)."""
        ...

    @property
    def kv_full_blocks(self) -> int:
        """A mixed pool's full-precision blocks (device ids below it; ``runner/kv_cache.py``); 0
        for a single-format pool."""
        ...

    @property
    def kv_quant_parts(self) -> str:
        """Which parts of an 8-bit block are 8-bit: "kv" (K and V), or "v" (K at the model dtype;
        ``EngineConfig.kv_quant_parts``)."""
        ...

    @property
    def kv_groups(self) -> tuple[KVGroup, ...]:
        """The KV groups of the cache (``model_shape.kv_groups``): one block table each."""
        ...

    @property
    def payload_bytes(self) -> int:
        """The exact size of one block's payload (``block_payloads``); a block file of another size
        is not this cache's."""
        ...

    @property
    def model_dtype(self) -> str:
        """The dtype the model computes in ("float32", "bfloat16", ...)."""
        ...

    @property
    def weight_bytes(self) -> int:
        """Bytes the model's weights take (parameters and buffers, shared ones once): the server's
        start-up summary."""
        ...

    @property
    def weights_quantization(self) -> str | None:
        """How the linear weights are stored when not in the model dtype ("q8_0"), else None:
        other weights, other K/V (part of the disk tier's fingerprint)."""
        ...

    def set_context_length(self, context: int) -> None:
        """The longest context the engine serves (longrope picks its factors by it)."""
        ...

    def execute(self, chunks: Sequence[SeqChunk], return_all_logits: bool = False) -> torch.Tensor:
        """One forward pass over ``chunks``; float32 logits ``[sum(c.num_logits), vocab]`` on the
        host. Raises BatchError for chunks it cannot run."""
        ...

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: device block src -> device block dst."""
        ...

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        """(device block, host block) pairs: device -> host."""
        ...

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        """(host block, device block) pairs: host -> device."""
        ...

    def block_payloads(self, block_ids: Sequence[int]) -> list[bytes]:
        """Device blocks as bytes (the disk tier's payload)."""
        ...

    def host_block_payloads(self, block_ids: Sequence[int]) -> list[bytes]:
        """Host blocks as bytes."""
        ...

    def load_host_blocks(self, pairs: Sequence[tuple[int, bytes]]) -> None:
        """(host block, payload) pairs read from the disk tier, written into the host pool."""
        ...

    def kv_quant_error(self) -> list[tuple[float, float]] | None:
        """Relative RMS error (K, V) per layer of what 8-bit blocks stored so far, or None."""
        ...

    def set_lora_slot(self, slot: int, weights: LoRAWeights | None) -> None:
        """Fill LoRA slot ``slot`` with an adapter's weights (None: empty it)."""
        ...

    def close(self) -> None:
        """Release what the runner holds besides memory (a tensor-parallel runner's worker ranks);
        idempotent, the engine's last call."""
        ...

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(message)`` once if the runner fails between calls (a tensor-parallel
        rank died); a runner on one device never does."""
        ...
