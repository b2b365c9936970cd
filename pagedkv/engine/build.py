"""From an EngineConfig to the engine's parts: the runner (load the model, size the device and
host KV pools), the speculative decoder, the LoRA manager. ``LLMEngine`` wires what these return;
nothing here imports the engine."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from pagedkv.engine.config import EngineConfig
from pagedkv.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from pagedkv.distributed.group import TPGroup
    from pagedkv.engine.kv_sizing import KVSizing
    from pagedkv.lora.manager import LoRAManager
    from pagedkv.model_shape import ModelShape
    from pagedkv.models.config import ModelConfig
    from pagedkv.models.tokenizer import Tokenizer
    from pagedkv.runner.protocol import Runner
    from pagedkv.speculative.decoder import SpeculativeDecoder

logger = logging.getLogger(__name__)


class RunnerParts(NamedTuple):
    """A loaded model on its runner, and what the engine takes from the model beside it."""

    runner: Runner
    tokenizer: Tokenizer | None
    model_name: str
    max_position_embeddings: int
    model_identity: dict[str, str] | None  # for the disk tier's fingerprint (models/identity.py)
    generation_defaults: dict[str, Any]    # sampling defaults (:func:`generation_defaults`)


def build_runner(config: EngineConfig) -> RunnerParts:
    """Load the model and size its KV pools. The identity (``models/identity.py``) is computed
    only for the disk tier's fingerprint, else None; the defaults are :func:`generation_defaults`'.
    ``tensor_parallel_size`` > 1: a ``TPRunner`` over that many ranks (``engine/tp_build.py``)."""
    if config.tensor_parallel_size > 1:
        from pagedkv.engine.tp_build import build_tp_runner
        parts: RunnerParts = build_tp_runner(config, build_rank_runner)
        return parts
    return build_rank_runner(config)[0]


def build_rank_runner(config: EngineConfig, tp: TPGroup | None = None) -> tuple[RunnerParts, ModelConfig]:
    """:func:`build_runner`'s work on one device, and the whole model's config beside it; with
    ``tp`` (a tensor-parallel rank) the rank's shard on its own ModelRunner, its pools' sizes
    agreed with rank 0's."""
    import torch

    from pagedkv.models import load_model
    from pagedkv.models.dtype import resolve_dtype
    from pagedkv.models.loader import release_freed_memory, resolve_model_path
    from pagedkv.models.packed_linear import PackedLinear
    from pagedkv.ops.kv_format import kv_format
    from pagedkv.runner import ModelRunner, bytes_per_block
    from pagedkv.runner.kv_cache import host_bytes_per_block, num_blocks_for_memory
    from pagedkv.runner.model_runner import resolve_device

    if config.threads and tp is None:  # (a rank's threads are set, and pinned, by engine/tp_build.py)
        torch.set_num_threads(config.threads)
    device = resolve_device(config.device)
    path, _ = resolve_model_path(config.model, config.revision, config.download_dir)
    dtype = getattr(torch, resolve_dtype(config.dtype, path))
    kv_dtype = kv_format(config.kv_cache_dtype, dtype).name
    model_dtype = str(dtype).removeprefix("torch.")
    k_dtype = model_dtype if config.kv_quant_parts == "v" else None  # K's kind where it is not kv_dtype
    quantization = config.quantization
    if device.type == "cuda":  # the 8-bit weight kernel is a CPU one: dequantize on the GPU
        if quantization == "q8_0":
            raise ValueError("quantization q8_0 runs on the CPU only; use quantization none (or auto) on cuda")
        quantization = "none"
    loaded = load_model(config.model, dtype=dtype, quantization=quantization, tokenizer=config.tokenizer,
                        revision=config.revision, download_dir=config.download_dir, tp=tp,
                        cpu_layout=device.type == "cpu")  # (as the CPU runner would: sooner is leaner)
    block_size = resolve_block_size(config.block_size, loaded.config,
                                    config.max_model_len or loaded.config.max_position_embeddings, device,
                                    seq_len=config.block_size_seq_len)
    per_block = bytes_per_block(loaded.config, block_size, kv_dtype, k_dtype)  # scales included (a rank's heads)
    sizing = kv_sizing(config, loaded, block_size, per_block, device.type,  # the defaults, from free memory
                       ranks=tp.size if tp else 1)
    logger.info("%s", sizing.reason)
    kv_memory, recent_blocks = recent_block_share(config, loaded.config, block_size, model_dtype,
                                                  config.kv_cache_memory or sizing.kv_bytes)
    device_blocks = config.num_kv_blocks or num_blocks_for_memory(
        loaded.config, block_size, kv_memory, kv_dtype, k_dtype)
    full_blocks = 0
    if config.kv_sink_blocks:  # a mixed pool: sink blocks (and full-precision requests) at the model dtype
        full_blocks, device_blocks = mixed_pool_blocks(config, loaded.config, block_size, kv_dtype,
                                                       model_dtype, device_blocks, kv_memory, k_dtype)
    # More host blocks than 4x the device pool buy nothing.
    host_bytes = int(config.kv_offloading_size * (1 << 30)) if sizing.host_bytes is None else sizing.host_bytes
    host_per_block = (host_bytes_per_block(loaded.config, block_size, kv_dtype, model_dtype, k_dtype)
                      if full_blocks else per_block)  # a mixed pool's host blocks hold either format
    host_blocks = min(host_bytes // host_per_block, 4 * device_blocks)
    if tp is not None:  # every rank holds the same blocks: rank 0's sizes
        from pagedkv.engine.tp_build import agree_pool_sizes
        block_size, device_blocks, host_blocks, full_blocks = agree_pool_sizes(
            tp, block_size, device_blocks, host_blocks, full_blocks)
    runner = ModelRunner(loaded, block_size=block_size, num_blocks=device_blocks,
                         num_host_blocks=host_blocks, kv_cache_dtype=kv_dtype, device=device,
                         max_loras=config.max_loras if config.enable_lora else 0,
                         max_lora_rank=config.max_lora_rank, kv_full_blocks=full_blocks,
                         cascade_attention=not config.disable_cascade_attn, kv_quant_parts=config.kv_quant_parts,
                         kv_recent_blocks=recent_blocks, native_layers=config.native_layers)
    head = runner.model.lm_head
    if isinstance(head, PackedLinear):  # every batch size's LM-head kernel built now: flat RSS later
        head.warm_up(config.max_num_seqs)
    release_freed_memory()  # the loading's and warm-up's freed heap pages back to the OS
    identity = None
    if config.kv_offload_dir is not None or config.kv_remote_url is not None:  # (the tiers' fingerprint)
        from pagedkv.models.identity import model_identity
        identity = model_identity(loaded.path)
    defaults = generation_defaults(config.generation_config, loaded.generation_defaults)
    return (RunnerParts(runner, loaded.tokenizer, loaded.name, loaded.config.max_position_embeddings, identity,
                        defaults), loaded.full_config or loaded.config)


def resolve_block_size(setting: int | str, shape: ModelShape, max_model_len: int, device: torch.device, *,
                       seq_len: int | None = None) -> int:
    """The block size the runner is built with: ``"auto"`` resolved for the model, the context and
    the device (``pagedkv/block_size.py``; the same call ``pagedkv size`` makes), logged with its
    reason (``seq_len``: the workload's typical sequence length, ``block_size_seq_len``); an explicit
    size as given, with a warning when it is costly (below 4, or below 16 past 8k tokens of context)."""
    import torch

    from pagedkv.block_size import Device, block_size_warning, choose_block_size, is_auto

    dev = Device(device.type, torch.cuda.get_device_name(device) if device.type == "cuda" else "")
    if is_auto(setting):
        choice = choose_block_size(shape, max_model_len, dev, seq_len=seq_len)
        logger.info("%s", choice)
        return choice.block_size
    assert isinstance(setting, int)  # EngineConfig checked it
    if (warning := block_size_warning(setting, max_model_len, dev)) is not None:
        logger.warning("%s", warning)
    return setting


def kv_sizing(config: EngineConfig, loaded: Any, block_size: int, block_bytes: int, device_type: str, *,
              ranks: int = 1) -> KVSizing:
    """The KV pool and host tier defaults (``engine/kv_sizing.py``): what ``kv_cache_memory`` /
    ``num_kv_blocks`` and ``kv_offloading_size`` leave unset, sized from the loaded model and the
    memory available now; returns a ``KVSizing`` (its ``reason`` is logged at start). ``ranks``:
    tensor-parallel ranks sharing this host's memory (each sizes from its share)."""
    from pagedkv.engine.config import _DefaultGiB
    from pagedkv.engine.kv_sizing import available_device_memory, available_host_memory, size_kv
    from pagedkv.models.quant_linear import weight_bytes
    from pagedkv.units import parse_bytes

    pool: int | None = None
    if config.num_kv_blocks:
        pool = config.num_kv_blocks * block_bytes
    elif config.kv_cache_memory is not None:
        pool = (config.kv_cache_memory if isinstance(config.kv_cache_memory, int)
                else parse_bytes(str(config.kv_cache_memory), "kv_cache_memory"))
    host = available_host_memory()
    if host is not None:
        host //= ranks
    return size_kv(block_bytes=block_bytes, block_size=block_size,
                   max_model_len=config.max_model_len or loaded.config.max_position_embeddings,
                   weight_bytes=weight_bytes(loaded.model),
                   device_available=host if device_type == "cpu" else available_device_memory(device_type),
                   host_available=host, pool_bytes=pool,
                   host_given=not isinstance(config.kv_offloading_size, _DefaultGiB),
                   same_memory=device_type == "cpu")


def recent_block_share(config: EngineConfig, shape: Any, block_size: int, model_dtype: str,
                       memory: str | int) -> tuple[str | int, int]:
    """(the KV memory left for the pool's own blocks, shadow blocks) for ``kv_recent_block``: one
    model-dtype shadow block per ``max_num_seqs`` (each running sequence's tail block), their bytes
    taken out of ``memory`` (with ``num_kv_blocks`` they come on top of the given blocks). Off:
    (``memory``, 0). ValueError when the shadows alone fill ``memory``."""
    from pagedkv.runner.kv_cache import bytes_per_block, parse_memory_size

    if not config.kv_recent_block:
        return memory, 0
    if config.num_kv_blocks:
        return memory, config.max_num_seqs
    total = parse_memory_size(memory)
    shadow_bytes = config.max_num_seqs * bytes_per_block(shape, block_size, model_dtype)
    if shadow_bytes >= total:
        raise ValueError(f"kv_recent_block: max_num_seqs={config.max_num_seqs} shadow blocks at {model_dtype} take "
                         f"{shadow_bytes} bytes, the whole KV memory ({total}); give more kv_cache_memory, a lower "
                         f"max_num_seqs, or kv_recent_block false")
    logger.info("kv_recent_block: %d %s shadow blocks (%d bytes) for sequences' tail blocks",
                config.max_num_seqs, model_dtype, shadow_bytes)
    return total - shadow_bytes, config.max_num_seqs


def mixed_pool_blocks(config: EngineConfig, shape: Any, block_size: int, kv_dtype: str, model_dtype: str,
                      device_blocks: int, memory: str | int, k_dtype: str | None = None) -> tuple[int, int]:
    """(full-precision blocks, all blocks) of a mixed pool for ``kv_sink_blocks``: the share
    ``ops/kv_format.full_block_fraction`` gives, raised to hold one full-precision request of
    ``max_model_len`` where that is at most half the pool, in ``num_kv_blocks`` blocks or in
    ``memory`` (the full-precision blocks take their own bytes, so fewer blocks fit; ``k_dtype``:
    the other blocks' K kind, ``kv_quant_parts`` "v")."""
    from pagedkv.ops.kv_format import full_block_fraction
    from pagedkv.runner.kv_cache import mixed_split

    max_len = config.max_model_len or shape.max_position_embeddings
    fraction = full_block_fraction(config.kv_sink_blocks, max_len, block_size)
    per_seq = -(-max_len // block_size)  # room for one full-precision request of max_model_len, where it fits
    if config.num_kv_blocks:
        if device_blocks < 2:
            raise ValueError("kv_sink_blocks needs num_kv_blocks >= 2 (a full-precision and an 8-bit block)")
        full = max(1, round(fraction * device_blocks), min(per_seq, device_blocks // 2))
        return min(device_blocks - 1, full), device_blocks
    full, quant = mixed_split(shape, block_size, memory, kv_dtype, model_dtype, fraction, k_dtype)
    if full < per_seq:
        full, quant = mixed_split(shape, block_size, memory, kv_dtype, model_dtype,
                                  min(0.5, max(fraction, per_seq / (full + quant))), k_dtype)
    logger.info("mixed KV pool: %d full-precision (%s) blocks for %d sink block(s) a sequence, %d %s blocks",
                full, model_dtype, config.kv_sink_blocks, quant, kv_dtype)
    return full, full + quant


def generation_defaults(setting: str, model_defaults: dict[str, Any]) -> dict[str, Any]:
    """The sampling defaults ``EngineConfig.generation_config`` names: "auto" the model's
    (``LoadedModel.generation_defaults``), "vllm" none, else those of the folder ``setting``'s
    generation_config.json (ValueError if it has none). A value SamplingParams refuses is
    dropped with a warning, so a bad file cannot fail every request."""
    from pagedkv.models.hf_loader import read_generation_defaults

    if setting == "vllm":
        return {}
    if setting == "auto":
        found = model_defaults
    else:
        folder = Path(setting).expanduser()
        if not (folder / "generation_config.json").is_file():
            raise ValueError(f"generation_config {setting!r} is not a folder holding a generation_config.json "
                             f"(give 'auto', 'vllm' or such a folder)")
        found = read_generation_defaults(folder)
    defaults: dict[str, Any] = {}
    for name, value in found.items():
        try:
            SamplingParams(**{name: value})
        except (ValueError, TypeError) as exc:
            logger.warning("generation_config: ignoring the default %s=%r: %s", name, value, exc)
        else:
            defaults[name] = value
    if defaults:
        logger.info("sampling defaults from generation_config: %s", defaults)
    return defaults


def build_speculative_decoder(config: EngineConfig, runner: Runner, tokenizer: Tokenizer | None,
                              max_model_len: int) -> SpeculativeDecoder | None:
    """The speculative decoder ``config.speculative_config`` asks for (``pagedkv/speculative``), or None.
    A draft model gets a runner and a memory core of its own, with the target's block size and
    (unless ``draft_kv_blocks`` says otherwise) as many blocks; ValueError when its tokenizer
    is not the target's."""
    spec = config.speculative
    if spec is None:
        return None
    from pagedkv.speculative.decoder import SpeculativeDecoder

    draft = None
    if spec.method == "draft_model":
        from pagedkv.memory import KVCacheManager
        from pagedkv.speculative.draft_model import DraftModelProposer

        target_vocab = runner.config.vocab_size
        draft_config = EngineConfig(model=spec.model, block_size=runner.block_size,
                                    num_kv_blocks=spec.draft_kv_blocks or runner.num_blocks, kv_offloading_size=0,
                                    max_num_seqs=config.max_num_seqs, dtype=config.dtype,
                                    quantization=config.quantization, generation_config="vllm",
                                    tokenizer=config.tokenizer, device=config.device)
        draft_runner, draft_tokenizer, draft_name, *_ = build_runner(draft_config)
        check_same_tokenizer(tokenizer, draft_tokenizer, draft_name)
        draft_kv = KVCacheManager(draft_runner.num_blocks, runner.block_size, watermark=0.0,
                                  kv_group_windows=kv_group_windows(draft_runner))
        draft = DraftModelProposer(draft_runner, draft_kv, config.max_num_batched_tokens,
                                   target_vocab)
        logger.info("speculative decoding: draft model %s, %d KV blocks, k=%d", draft_name,
                    draft_runner.num_blocks, spec.num_speculative_tokens)
    return SpeculativeDecoder(spec, max_model_len, draft)


def kv_group_windows(runner: Runner) -> tuple[int | None, ...]:
    """The memory core's KV groups for the runner's cache (``model_shape.kv_groups``): one per
    group, its window or None."""
    return tuple(g.window for g in runner.kv_groups) or (None,)


def build_lora_manager(config: EngineConfig, runner: Runner) -> LoRAManager | None:
    """The adapters' manager of an engine with ``enable_lora`` (its runner built with LoRA slots)."""
    if not config.enable_lora:
        return None
    if runner.lora is None:
        raise ValueError("enable_lora: the runner has no LoRA slots (build it with max_loras > 0)")
    from pagedkv.lora.manager import LoRAManager

    return LoRAManager(runner, runner.config, max_loras=config.max_loras, max_rank=config.max_lora_rank,
                       max_cpu_loras=config.max_cpu_loras or config.max_loras)


def check_same_tokenizer(target, draft, draft_name: str) -> None:
    """ValueError unless the draft model's tokenizer maps text to the target's ids (same vocabulary)."""
    if target is None or draft is None:
        return
    a, b = target.backend.get_vocab(), draft.backend.get_vocab()
    if a != b:
        differing = len(set(a.items()) ^ set(b.items()))
        raise ValueError(f"speculative_config: the draft model {draft_name!r} has another tokenizer than the "
                         f"target ({len(b)} vs {len(a)} tokens, {differing} entries differ); a draft model "
                         f"must share the target's vocabulary")
