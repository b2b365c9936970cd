"""The engine's one frozen, validated configuration (vLLM's option names)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from pagedkv.engine.faults import FaultSpec
from pagedkv.memory import EVICTION_POLICIES
from pagedkv.memory.prefix_index import PREFIX_INDEXES
from pagedkv.memory.tenancy import check_fraction, parse_quotas
from pagedkv.model_shape import KV_CACHE_DTYPES, check_block_size
from pagedkv.speculative.config import SpeculativeConfig
from pagedkv.units import parse_bytes
from pagedkv.weight_quant import QUANTIZATIONS

PREEMPTION_MODES = ("auto", "recompute", "swap")
DEVICES = ("cpu", "cuda", "auto")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEFAULT_KV_CACHE_MEMORY = "1GiB"
DEFAULT_HOST_TIER_GIB = 0.5
DEFAULT_DISK_TIER_SIZE = "20GiB"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Every engine option, validated once at construction; bad values raise ValueError naming
    the field and the allowed range.

    ``kv_cache_memory`` (bytes or a size string like "2GiB") or ``num_kv_blocks`` sizes the
    device KV pool (default 1 GiB). ``kv_offloading_size`` (vLLM's name) is the host tier in GiB
    (default 0.5): the one host pool, holding swapped-out sequences and the cached prefix blocks
    evicted from the device; ``swap_space`` is its deprecated alias (give one of the two).
    ``kv_offload_dir`` adds the disk tier below it (a directory of checksummed block files that
    survives restarts; see docs/kv_tiers.md) of ``kv_offload_disk_size`` (default 20GiB).
    ``max_step_time_s`` (default 1.5; 0: off) budgets each step in seconds besides the
    ``max_num_batched_tokens`` tokens: the scheduler sizes prefill chunks by the step-time estimate
    (``engine/step_cost.py``, fitted to measured steps), so streams beside a long prompt keep their
    inter-token gaps near it.
    ``preemption_mode`` "auto" (default) swaps or recomputes a preempted request, whichever the
    engine's measured costs say is cheaper.
    ``max_model_len`` defaults to the model's context length. ``fault_injection`` (or the
    ``PAGEDKV_FAULT_INJECTION`` environment variable) takes a spec such as "seed=7,rate=0.05".
    ``debug_integrity`` runs ``check_integrity()`` after every step. ``dtype`` "auto" (default)
    is the checkpoint's dtype where the hardware computes in it natively, else float32 (see
    ``pagedkv/models/dtype.py``). ``prefix_index`` picks the
    structure that finds cached prefixes: the SHA-256 hash chain ("hash") or a radix tree over
    token ids ("radix"); both find the same blocks. ``kv_cache_dtype`` is the KV block format:
    "auto" (the model dtype), a float dtype, or 8-bit blocks with one scale per block, layer, K/V
    and KV head ("int8", "fp8" = "fp8_e4m3", "fp8_e5m2"; see docs/kv_quantization.md).
    ``quantization`` is the format of the linear weights: "none" (the model dtype), "q8_0" (int8
    with a scale, and an offset where needed, per 32 values; other GGUF types requantized), "auto"
    (default: a GGUF's weights kept 8-bit where that is exact, the rest dequantized, so the values
    are the file's; else "none"; see ``pagedkv/weight_quant.py``).
    ``generation_config`` (vLLM's ``--generation-config``) gives the sampling defaults for fields a
    request leaves out: "auto" (default) the model folder's generation_config.json (temperature,
    top_p, top_k, min_p, repetition_penalty, max_new_tokens as max_tokens; a GGUF file has none),
    "vllm" the neutral defaults of SamplingParams, or a folder holding a generation_config.json.
    ``tenant_kv_quota`` ("NAME=FRACTION" items) and ``default_tenant_kv_quota`` limit the device
    KV blocks each tenant holds, in use plus cached, as fractions of the pool (``memory/tenancy.py``):
    over its quota a tenant's own cached blocks go first and its new requests wait.
    ``max_pin_ttl_s`` bounds (and is the default of) a request's ``pin_ttl_s``: how long a
    conversation's prefix stays pinned after a turn (``memory/pins.py``).
    ``max_tenant_pin_fraction`` (None: no limit but the pool) caps the share of the device pool one
    tenant's conversation pins hold: a pin past it is refused, and the response's cache details
    say so.
    ``speculative_config`` (vLLM's shape, a dict or its JSON text) turns on speculative decoding:
    ``{"method": "ngram", "num_speculative_tokens": 4}`` or ``{"method": "draft_model", "model":
    PATH, "num_speculative_tokens": 4}`` (``pagedkv/speculative``; docs/speculative_decoding.md).
    ``kv_events`` records KV cache events (``memory/kv_events.py``; the server publishes them
    with ``--kv-events-endpoint``, which turns this on).
    ``device``: "cpu" (default), "cuda" or "auto" (CUDA when torch sees a GPU): where the model,
    the KV pool and the attention kernels run (Triton on CUDA; the host tier stays in host memory).
    A Hugging Face repo id as ``model`` that is not in the cache is downloaded from the Hub
    (``pagedkv/models/hub.py``; never with HF_HUB_OFFLINE=1): ``revision`` (a branch, tag or commit;
    default "main") and ``download_dir`` (the Hugging Face cache to use; default Hugging Face's own)
    are vLLM's ``--revision`` and ``--download-dir``.
    ``tokenizer`` (vLLM's ``--tokenizer``) replaces the model's tokenizer: a folder with
    tokenizer.json, a .gguf file, or a cached Hugging Face repo id (``pagedkv.models.load_tokenizer``).
    ``enable_lora`` serves LoRA adapters (``pagedkv/lora``, docs/lora.md): ``max_loras`` of them
    in one step (slots preallocated at rank ``max_lora_rank``), ``max_cpu_loras`` (default
    ``max_loras``) kept read in memory while idle.
    ``grammar_compile_timeout_s``, ``grammar_memory_mib``, ``grammar_max_lexer_states``,
    ``grammar_max_spec_chars``, ``max_guided_choices`` and ``grammar_cache_mib`` bound what one
    structured-output grammar may cost (``engine/grammar_compiler.py``): the compile's wall time
    and memory (in its worker process), llguidance's lexer states (also at every step), the
    schema's or regex's characters, the choices of a choice list, and the compiled grammars kept.
    Past one the request is refused, naming it.
    """

    model: str | None = None
    tokenizer: str | None = None
    revision: str | None = None
    download_dir: str | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory: str | int | None = None
    num_kv_blocks: int | None = None
    kv_offloading_size: float | None = None
    swap_space: float | None = None  # deprecated alias of kv_offloading_size
    kv_offload_dir: str | None = None
    kv_offload_disk_size: str | int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_step_time_s: float = 1.5
    max_model_len: int | None = None
    preemption_mode: str = "auto"
    eviction_policy: str = "lru"
    prefix_index: str = "hash"
    watermark: float = 0.01
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    quantization: str = "auto"
    seed: int = 0
    debug_integrity: bool = False
    fault_injection: str | None = None
    threads: int | None = None
    generation_config: str = "auto"
    tenant_kv_quota: tuple[str, ...] | list[str] | None = None
    default_tenant_kv_quota: float | None = None
    max_pin_ttl_s: float = 600.0
    max_tenant_pin_fraction: float | None = None
    speculative_config: str | dict | SpeculativeConfig | None = None
    kv_events: bool = False
    device: str = "cpu"
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    grammar_compile_timeout_s: float = 10.0
    grammar_memory_mib: int = 1024
    grammar_max_lexer_states: int = 50_000  # llguidance's max_lexer_states (~1-2 kB each)
    grammar_max_spec_chars: int = 1 << 20
    max_guided_choices: int = 10_000
    grammar_cache_mib: int = 256

    def __post_init__(self) -> None:
        check_block_size(self.block_size)
        _int_in("max_num_seqs", self.max_num_seqs, 1, 1 << 20)
        _int_in("max_num_batched_tokens", self.max_num_batched_tokens, 1, 1 << 24)
        if isinstance(self.max_step_time_s, bool) or not isinstance(self.max_step_time_s, (int, float)) \
                or not 0 <= self.max_step_time_s <= 3600:
            raise ValueError(f"max_step_time_s must be a number of seconds in [0, 3600] (0: no time budget), "
                             f"got {self.max_step_time_s!r}")
        if self.kv_cache_memory is not None:
            size = (self.kv_cache_memory if isinstance(self.kv_cache_memory, int)
                    and not isinstance(self.kv_cache_memory, bool)
                    else parse_bytes(str(self.kv_cache_memory), "kv_cache_memory"))
            if size <= 0:
                raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory!r}")
        if self.num_kv_blocks is not None:
            _int_in("num_kv_blocks", self.num_kv_blocks, 1, 1 << 30)
            if self.kv_cache_memory is not None:
                raise ValueError("give kv_cache_memory or num_kv_blocks, not both")
        if self.max_model_len is not None:
            _int_in("max_model_len", self.max_model_len, 1, 1 << 24)
        if self.tenant_kv_quota is not None:
            items = [self.tenant_kv_quota] if isinstance(self.tenant_kv_quota, str) else self.tenant_kv_quota
            object.__setattr__(self, "tenant_kv_quota", tuple(str(item) for item in items))
            parse_quotas(self.tenant_kv_quota)
        if self.default_tenant_kv_quota is not None:
            check_fraction(self.default_tenant_kv_quota, "default_tenant_kv_quota")
        if not isinstance(self.max_pin_ttl_s, (int, float)) or not 0 < self.max_pin_ttl_s <= 86400:
            raise ValueError(f"max_pin_ttl_s must be in (0, 86400] seconds, got {self.max_pin_ttl_s!r}")
        if self.max_tenant_pin_fraction is not None:
            check_fraction(self.max_tenant_pin_fraction, "max_tenant_pin_fraction")
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        if not isinstance(self.device, str) or not (self.device in DEVICES or self.device.startswith("cuda:")):
            raise ValueError(f"device must be one of {DEVICES} (or cuda:N), got {self.device!r}")
        if self.threads is not None:
            _int_in("threads", self.threads, 1, 1024)
        for name in ("revision", "download_dir"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        _int_in("max_loras", self.max_loras, 1, 256)
        _int_in("max_lora_rank", self.max_lora_rank, 1, 512)
        if self.max_cpu_loras is not None:
            _int_in("max_cpu_loras", self.max_cpu_loras, self.max_loras, 1 << 16)
        t = self.grammar_compile_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 3600:
            raise ValueError(f"grammar_compile_timeout_s must be in (0, 3600] seconds, got {t!r}")
        _int_in("grammar_memory_mib", self.grammar_memory_mib, 64, 1 << 20)
        _int_in("grammar_max_lexer_states", self.grammar_max_lexer_states, 16, 1 << 24)
        _int_in("grammar_max_spec_chars", self.grammar_max_spec_chars, 16, 1 << 30)
        _int_in("max_guided_choices", self.max_guided_choices, 1, 1 << 24)
        _int_in("grammar_cache_mib", self.grammar_cache_mib, 0, 1 << 20)
        for name in ("kv_offloading_size", "swap_space"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not value >= 0):
                raise ValueError(f"{name} must be a number of GiB >= 0, got {value!r}")
        if self.kv_offloading_size is not None and self.swap_space is not None:
            raise ValueError("give kv_offloading_size (the host tier, GiB) or its deprecated alias "
                             "swap_space, not both")
        if self.kv_offload_disk_size is not None:
            if self.kv_offload_dir is None:
                raise ValueError("kv_offload_disk_size sizes the disk tier: give kv_offload_dir (the directory) too")
            if self.disk_tier_bytes <= 0:
                raise ValueError(f"kv_offload_disk_size must be > 0 bytes, got {self.kv_offload_disk_size!r}")
        if self.kv_offload_dir is not None:
            if not isinstance(self.kv_offload_dir, str) or not self.kv_offload_dir.strip():
                raise ValueError(f"kv_offload_dir must be a directory path, got {self.kv_offload_dir!r}")
            if self.host_tier_gib <= 0:
                raise ValueError("the disk tier (kv_offload_dir) reads blocks back through the host tier: "
                                 "give kv_offloading_size > 0 (GiB)")
            if not self.enable_prefix_caching:
                raise ValueError("the disk tier (kv_offload_dir) holds prefix-cache blocks: it needs "
                                 "enable_prefix_caching")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        _one_of("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        _one_of("eviction_policy", self.eviction_policy, EVICTION_POLICIES)
        _one_of("prefix_index", self.prefix_index, PREFIX_INDEXES)
        _one_of("dtype", self.dtype, DTYPES)
        _one_of("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _one_of("quantization", self.quantization, QUANTIZATIONS)
        if self.fault_injection:
            FaultSpec.parse(self.fault_injection)
        if not isinstance(self.generation_config, str) or not self.generation_config.strip():
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder holding a "
                             f"generation_config.json, got {self.generation_config!r}")

    @classmethod
    def from_options(cls, model: str | None = None, **options: object) -> EngineConfig:
        """Build from keyword options; unknown names raise TypeError listing the valid ones.

        ``fault_injection`` falls back to the PAGEDKV_FAULT_INJECTION environment variable.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; valid options: {sorted(names)}")
        if options.get("fault_injection") is None and os.environ.get("PAGEDKV_FAULT_INJECTION"):
            options["fault_injection"] = os.environ["PAGEDKV_FAULT_INJECTION"]
        return cls(model=model, **options)  # type: ignore[arg-type]

    def with_max_model_len(self, max_model_len: int) -> EngineConfig:
        """The config with ``max_model_len`` resolved (done once, when the model is known)."""
        return dataclasses.replace(self, max_model_len=max_model_len)

    @property
    def host_tier_gib(self) -> float:
        """GiB of host memory for the host tier (``kv_offloading_size``, or ``swap_space``)."""
        if self.kv_offloading_size is not None:
            return float(self.kv_offloading_size)
        if self.swap_space is not None:
            return float(self.swap_space)
        return DEFAULT_HOST_TIER_GIB

    @property
    def tenant_quotas(self) -> dict[str, float]:
        """``tenant_kv_quota`` as ``{tenant: fraction}``."""
        return parse_quotas(self.tenant_kv_quota)

    @property
    def disk_tier_bytes(self) -> int:
        """Bytes of the disk tier (``kv_offload_disk_size``, default 20GiB); used with ``kv_offload_dir``."""
        size = self.kv_offload_disk_size
        if size is None:
            size = DEFAULT_DISK_TIER_SIZE
        if isinstance(size, int) and not isinstance(size, bool):
            return size
        return parse_bytes(str(size), "kv_offload_disk_size")

    @property
    def speculative(self) -> SpeculativeConfig | None:
        return self.speculative_config  # type: ignore[return-value]  (parsed in __post_init__)

    @property
    def faults(self) -> FaultSpec | None:
        return FaultSpec.parse(self.fault_injection) if self.fault_injection else None


def _int_in(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r}")


def _one_of(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
