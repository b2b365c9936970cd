"""The engine's one frozen, validated configuration (vLLM's option names)."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

from pagedkv import envs
from pagedkv.block_size import check_block_size_setting
from pagedkv.engine.faults import FaultSpec
from pagedkv.memory import EVICTION_POLICIES
from pagedkv.memory.prefix_index import PREFIX_INDEXES
from pagedkv.memory.tenant_ledger import check_fraction, parse_quotas
from pagedkv.memory.tiers.remote_store import check_url, require_client
from pagedkv.model_shape import KV_CACHE_DTYPES, KV_DTYPE_ALIASES, SCALED_KV_DTYPES, check_kv_quant_parts
from pagedkv.speculative.config import SpeculativeConfig
from pagedkv.units import parse_bytes
from pagedkv.weight_quant import QUANTIZATIONS

PREEMPTION_MODES = ("auto", "recompute", "swap")
DEVICES = ("cpu", "cuda", "auto")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEFAULT_KV_CACHE_MEMORY = "1GiB"


class _DefaultGiB(float):
    """``kv_offloading_size``'s default, marked as such: giving the option (even at 0.5) beside its
    deprecated alias ``swap_space`` is refused, which a plain 0.5 could not tell from the default;
    and the default host tier is sized from the pool and the free memory (``engine/kv_sizing.py``),
    not taken as 0.5 GiB (the value only keeps the float checks' meaning: a host tier exists)."""

    def __repr__(self) -> str:
        return "auto"


DEFAULT_HOST_TIER_GIB: float = _DefaultGiB(0.5)
DEFAULT_DISK_TIER_SIZE = "20GiB"

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Every engine option, validated once at construction; bad values raise ValueError naming
    the field and the allowed range.

    Each field is documented once, in its ``metadata["help"]``: the command-line flags are made
    from the fields (``engine/flags.py``: a field's name with dashes, vLLM's names, and that help)
    and so is the table of options in docs/configuration.md (``python -m pagedkv.engine.flags``).
    Derived values are properties (``disk_tier_bytes``, ``tenant_quotas``).
    """

    model: str | None = field(default=None, metadata={"help": (
        "the model: a Hugging Face folder, a .gguf file (or a folder holding one), or a Hugging Face repo "
        "id (downloaded from the Hub when not in the local cache, never with HF_HUB_OFFLINE=1; "
        "pagedkv/models/hub.py) (default: the bundled SmolLM2-135M-Instruct)")})
    tokenizer: str | None = field(default=None, metadata={"help": (
        "a tokenizer instead of the model's (vLLM's --tokenizer): a folder with tokenizer.json, a .gguf "
        "file or a cached Hugging Face repo id (default: the model's own)")})
    revision: str | None = field(default=None, metadata={"help": (
        "the branch, tag or commit of a Hugging Face repo id given as the model (vLLM's --revision; "
        "default main)")})
    download_dir: str | None = field(default=None, metadata={"help": (
        "the Hugging Face cache a repo id given as the model is looked up in and downloaded into (vLLM's "
        "--download-dir; default: Hugging Face's own, $HF_HUB_CACHE or ~/.cache/huggingface/hub)")})
    block_size: int | str = field(default=16, metadata={"help": (
        "token slots per KV block, or auto: chosen from the model, max_model_len and the device's measured "
        "kernel preference, and logged with its reason (docs/block_size.md; `pagedkv serve`'s default); "
        "below 4, or below 16 with contexts beyond 8k tokens, logs a warning naming the cost")})
    block_size_seq_len: int | None = field(default=None, metadata={"help": (
        "with block_size auto, the workload: the typical length in tokens of a running sequence (prompt and "
        "output so far; `pagedkv size --dataset ...` prints its mean live length); auto then weighs the "
        "kernels' measured speed against tail waste at that length instead of at max_model_len")})
    enable_prefix_caching: bool = field(default=True, metadata={"help": "share KV blocks of common prompt prefixes"})
    kv_cache_memory: str | int | None = field(default=None, metadata={"help": (
        "memory for the device KV pool: bytes or a size such as 512MiB, 2GiB, 4G (= 4GiB, as vLLM's "
        "--kv-cache-memory-bytes reads it; 4g and 4GB are 4 x 1000^3); give it or num_kv_blocks (default: "
        "room for one max_model_len sequence and at least 2x the weights, within half the memory available "
        "after loading; engine/kv_sizing.py, logged at start)")})
    num_kv_blocks: int | None = field(default=None, metadata={"help": (
        "number of device KV blocks (instead of kv_cache_memory)")})
    kv_offloading_size: float = field(default=DEFAULT_HOST_TIER_GIB, metadata={"help": (
        "the host tier in GiB (vLLM's name): the one host pool, holding swapped-out sequences and the "
        "cached prefix blocks evicted from the device; swap_space is its deprecated alias (give one of "
        "the two) (default: an eighth of a CPU KV pool, half of a GPU's, 0.5 beside a configured pool; within "
        "a quarter of the host memory left; logged at start)")})
    swap_space: float | None = field(default=None, metadata={"help": "deprecated alias of kv_offloading_size"})
    kv_offload_dir: str | None = field(default=None, metadata={"help": (
        "directory of the disk tier below the host tier: checksummed block files of evicted prefix blocks "
        "that persist across restarts (owner-only; wipe with `pagedkv kv-cache clear DIR`; "
        "docs/kv_tiers.md)")})
    kv_offload_disk_size: str | int | None = field(default=None, metadata={"help": (
        "size of the disk tier, e.g. 20GiB (default 20GiB; needs kv_offload_dir)")})
    kv_remote_url: str | None = field(default=None, repr=False, metadata={"help": (
        "a KV tier shared by every replica, below the disk (or host) tier: redis://[USER:PASSWORD@]HOST:PORT[/DB] "
        "(rediss:// for TLS) of a Redis 7 or Valkey server; blocks one replica computed, the others load "
        "instead of recomputing (needs the redis extra: pip install 'pagedkv[redis]'; docs/kv_tiers.md)")})
    kv_remote_key_prefix: str = field(default="pagedkv:", metadata={"help": (
        "start of every key the remote tier writes, to share one server among deployments")})
    max_num_seqs: int = field(default=64, metadata={"help": "most sequences in one batch"})
    max_num_batched_tokens: int = field(default=2048, metadata={"help": "most tokens in one step (chunked prefill)"})
    max_step_time_s: float = field(default=1.5, metadata={"help": (
        "seconds one step should take at most: prefill chunks are sized by the engine's step-time "
        "estimate (engine/step_cost.py, fitted to its measured steps) so that streams beside a long "
        "prompt keep their inter-token gaps near it; decodes always run; 0: off, the token budget alone")})
    max_model_len: int | None = field(default=None, metadata={"help": (
        "longest prompt plus output, in tokens (default: the model's context length)")})
    preemption_mode: str = field(default="auto", metadata={"help": (
        "how to preempt under memory pressure: auto swaps or recomputes a preempted request, whichever "
        "the engine's measured costs say is cheaper")})
    eviction_policy: str = field(default="lru", metadata={"help": "which cached blocks to evict first"})
    prefix_index: str = field(default="hash", metadata={"help": (
        "how cached prefixes are found: SHA-256 hash chain (hash) or a radix tree over token ids (radix); "
        "both find the same blocks")})
    watermark: float = field(default=0.01, metadata={"help": (
        "fraction of the KV pool kept free when admitting requests")})
    dtype: str = field(default="auto", metadata={"help": (
        "model dtype; auto: the checkpoint's where the hardware computes in it natively, else float32 "
        "(pagedkv/models/dtype.py)")})
    kv_cache_dtype: str = field(default="auto", metadata={"help": (
        "KV block format: auto (the model dtype), a float dtype, or 8-bit blocks with one scale per "
        "block, layer, K/V and KV head: int8, fp8 (= fp8_e4m3), fp8_e5m2 (docs/kv_quantization.md)")})
    kv_sink_blocks: int = field(default=0, metadata={"help": (
        "with an 8-bit kv_cache_dtype: the first blocks of every sequence (the attention sinks) kept at the "
        "model dtype in a mixed pool, the rest 8-bit; the pool gives full-precision blocks a share sized from "
        "this and max_model_len, and requests may ask for full-precision KV (kv_cache_dtype in the request); "
        "every attention backend reads it (docs/kv_quantization.md)")})
    kv_quant_parts: str = field(default="kv", metadata={"help": (
        "with an 8-bit kv_cache_dtype: which parts of a block are 8-bit: kv (K and V), or v (V 8-bit, K at "
        "the model dtype: K's rounding costs more top-1 agreement than V's; a float32 model's blocks then hold "
        "1.6x float32 blocks' tokens, not 4x); with kv_sink_blocks or without (docs/kv_quantization.md)")})
    kv_recent_block: bool = field(default=False, metadata={"help": (
        "with an 8-bit kv_cache_dtype: each sequence's tail block, while it fills, is also kept at the model "
        "dtype in a shadow block that attention reads in its place (closer to the model dtype's outputs: "
        "docs/kv_quantization.md has the figures); max_num_seqs shadow blocks at the model dtype come out of "
        "the pool's memory; not for MLA or sliding-window models")})
    quantization: str = field(default="auto", metadata={"help": (
        "linear weights: none (the model dtype), q8_0 (int8 + a scale and offset per 32 values; GGUF "
        "types it cannot hold exactly are requantized), auto: a GGUF's weights kept 8-bit where exact "
        "(Q8_0, Q4_0/1, Q5_0/1, Q4_K, Q5_K), the rest dequantized, so the values are the file's; else "
        "none (pagedkv/weight_quant.py)")})
    seed: int = field(default=0, metadata={"help": "global random seed"})
    debug_integrity: bool = field(default=False, metadata={"help": (
        "check KV-cache integrity (check_integrity()) after every step")})
    fault_injection: str | None = field(default=None, metadata={"help": (
        "inject faults, e.g. seed=7,rate=0.05 (also env PAGEDKV_FAULT_INJECTION)")})
    threads: int | None = field(default=None, metadata={"help": (
        "torch CPU threads, per tensor-parallel rank (default: torch's choice; with tensor_parallel_size > 1 "
        "the cores divided among the ranks)")})
    tensor_parallel_size: int = field(default=1, metadata={"help": (
        "ranks one model is split over (vLLM's name, -tp): each holds 1/N of every layer and its KV heads' "
        "part of every block; pagedkv spawns ranks 1..N-1 (gloo on CPU, each pinned to its own cores when "
        "N x threads fit; NCCL on cuda:RANK), or torchrun launches them (docs/tensor_parallel.md)")})
    generation_config: str = field(default="auto", metadata={"help": (
        "sampling defaults for fields a request leaves out (vLLM's --generation-config): auto (the model "
        "folder's generation_config.json: temperature, top_p, top_k, min_p, repetition_penalty, "
        "max_new_tokens as max_tokens; a GGUF file has none), vllm (the neutral defaults of "
        "SamplingParams), or a folder holding a generation_config.json")})
    tenant_kv_quota: tuple[str, ...] | list[str] | None = field(default=None, metadata={"help": (
        "NAME=FRACTION: the share of the device KV pool tenant NAME may hold, in use plus cached; over "
        "it, its own cached blocks are evicted first and its new requests wait (repeat the flag for more "
        "tenants; memory/tenant_ledger.py)")})
    default_tenant_kv_quota: float | None = field(default=None, metadata={"help": (
        "the share of the device KV pool each tenant without a tenant_kv_quota may hold (default: no "
        "limit)")})
    max_pin_ttl_s: float = field(default=600.0, metadata={"help": (
        "the longest a request's conversation_id may keep its prefix pinned in the KV cache after a turn "
        "(pin_ttl_s), and its default, in seconds (memory/pins.py)")})
    max_tenant_pin_fraction: float | None = field(default=None, metadata={"help": (
        "the largest share of the device KV pool one tenant's conversation pins may hold; a pin past it "
        "is refused, with a warning in the response's cache details (default: no limit but the pool)")})
    speculative_config: str | dict | SpeculativeConfig | None = field(default=None, metadata={"help": (
        "speculative decoding, as a JSON object (vLLM's; in Python also a dict): "
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5} or '
        '{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4} (docs/speculative_decoding.md) '
        "(default: off)")})
    kv_events: bool = field(default=False, metadata={"help": (
        "record KV cache events (prefix blocks stored and removed per tier) for KV-aware routers; pagedkv "
        "serve --kv-events-endpoint publishes them, and turns this on")})
    device: str = field(default="cpu", metadata={"help": (
        "where the model, the KV pool and attention run: cpu, cuda (Triton kernels; also cuda:N) or auto "
        "(cuda when a GPU is visible); the host tier stays in host memory")})
    disable_cascade_attn: bool = field(default=False, metadata={"help": (
        "attend every row alone: turns off shared-block (cascade) attention, which attends the blocks several "
        "rows of a step hold at the same positions (a cached prefix, the parent blocks of n > 1 and beam "
        "forks) once for all of them (the native CPU kernel and the Triton decode kernel; pagedkv/ops/cascade.py) "
        "(vLLM's name)")})
    native_layers: bool = field(default=True, metadata={"help": (
        "run each dense decoder layer (Llama, Mistral, Qwen2/3, Phi-3, Gemma 2/3; not MoE or MLA, not LoRA, one "
        "rank) in one native call on the steps every row of which the native kernel attends: the same kernels "
        "and results as the layer's modules, without the Python between them (about 3 ms a token at batch 1 on "
        "the default model; pagedkv/models/native_layer.py); "
        "--no-native-layers runs them as modules")})
    enable_lora: bool = field(default=False, metadata={"help": (
        "serve LoRA adapters (--lora-modules, or selected per request; docs/lora.md)")})
    max_loras: int = field(default=1, metadata={"help": (
        "most distinct LoRA adapters computed in one step (their slots are preallocated)")})
    max_lora_rank: int = field(default=16, metadata={"help": "the highest LoRA rank served (slot size)"})
    max_cpu_loras: int | None = field(default=None, metadata={"help": (
        "LoRA adapters kept read in memory while idle (default: max_loras)")})
    grammar_compile_timeout_s: float = field(default=10.0, metadata={"help": (
        "longest one structured-output grammar may take to compile (in a worker process); past it the "
        "request gets a 400 (engine/grammar_compiler.py)")})
    grammar_memory_mib: int = field(default=1024, metadata={"help": (
        "memory one grammar compile may map in the worker process (MiB); past it the request gets a 400")})
    grammar_max_lexer_states: int = field(default=50_000, metadata={"help": (
        "most lexer states one grammar may build (llguidance's max_lexer_states, ~1-2 kB each), at "
        "compile time and while generating")})
    grammar_max_spec_chars: int = field(default=1 << 20, metadata={"help": (
        "most characters of a JSON schema, regex or choice list (as JSON)")})
    max_guided_choices: int = field(default=10_000, metadata={"help": "most strings in a guided_choice list"})
    grammar_cache_mib: int = field(default=256, metadata={"help": (
        "memory for compiled grammars kept for reuse, by their text (MiB)")})

    def __post_init__(self) -> None:
        check_block_size_setting(self.block_size)
        if self.block_size_seq_len is not None:
            _int_in("block_size_seq_len", self.block_size_seq_len, 1, 1 << 24)
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
        _int_in("tensor_parallel_size", self.tensor_parallel_size, 1, 1024)
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
        if self.swap_space is not None:  # the deprecated alias: read as kv_offloading_size from here on
            if not isinstance(self.kv_offloading_size, _DefaultGiB):  # given too, whatever its value
                raise ValueError("give kv_offloading_size (the host tier, GiB) or its deprecated alias "
                                 "swap_space, not both")
            logger.warning("swap_space is deprecated: it is an alias of kv_offloading_size (--kv-offloading-size), "
                           "the size of the host tier in GiB")
            object.__setattr__(self, "kv_offloading_size", float(self.swap_space))
            object.__setattr__(self, "swap_space", None)
        if self.kv_offload_disk_size is not None:
            if self.kv_offload_dir is None:
                raise ValueError("kv_offload_disk_size sizes the disk tier: give kv_offload_dir (the directory) too")
            if self.disk_tier_bytes <= 0:
                raise ValueError(f"kv_offload_disk_size must be > 0 bytes, got {self.kv_offload_disk_size!r}")
        if self.kv_offload_dir is not None:
            if not isinstance(self.kv_offload_dir, str) or not self.kv_offload_dir.strip():
                raise ValueError(f"kv_offload_dir must be a directory path, got {self.kv_offload_dir!r}")
            if self.kv_offloading_size <= 0:
                raise ValueError("the disk tier (kv_offload_dir) reads blocks back through the host tier: "
                                 "give kv_offloading_size > 0 (GiB)")
            if not self.enable_prefix_caching:
                raise ValueError("the disk tier (kv_offload_dir) holds prefix-cache blocks: it needs "
                                 "enable_prefix_caching")
        if self.kv_remote_url is not None:
            check_url(self.kv_remote_url)
            require_client()  # before the model loads: a missing `redis` says what to install
            if self.kv_offloading_size <= 0:
                raise ValueError("the remote tier (kv_remote_url) loads blocks through the host tier: give "
                                 "kv_offloading_size > 0 (GiB)")
            if not self.enable_prefix_caching:
                raise ValueError("the remote tier (kv_remote_url) shares prefix-cache blocks: it needs "
                                 "enable_prefix_caching")
        if not isinstance(self.kv_remote_key_prefix, str) or len(self.kv_remote_key_prefix) > 256:
            raise ValueError(f"kv_remote_key_prefix must be a string of at most 256 characters, got "
                             f"{self.kv_remote_key_prefix!r:.80}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        _one_of("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        _one_of("eviction_policy", self.eviction_policy, EVICTION_POLICIES)
        _one_of("prefix_index", self.prefix_index, PREFIX_INDEXES)
        _one_of("dtype", self.dtype, DTYPES)
        _one_of("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _int_in("kv_sink_blocks", self.kv_sink_blocks, 0, 1 << 20)
        eight_bit = KV_DTYPE_ALIASES.get(self.kv_cache_dtype, self.kv_cache_dtype) in SCALED_KV_DTYPES
        if self.kv_sink_blocks and not eight_bit:
            raise ValueError(f"kv_sink_blocks keeps sink blocks at the model dtype beside 8-bit ones: it needs an "
                             f"8-bit kv_cache_dtype (int8, fp8, fp8_e5m2), got {self.kv_cache_dtype!r}")
        check_kv_quant_parts(self.kv_quant_parts, self.kv_cache_dtype)
        if not isinstance(self.native_layers, bool):
            raise ValueError(f"native_layers must be true or false, got {self.native_layers!r}")
        if not isinstance(self.kv_recent_block, bool):
            raise ValueError(f"kv_recent_block must be true or false, got {self.kv_recent_block!r}")
        if self.kv_recent_block and not eight_bit:
            raise ValueError(f"kv_recent_block keeps the tail block at the model dtype beside 8-bit blocks: it needs "
                             f"an 8-bit kv_cache_dtype (int8, fp8, fp8_e5m2), got {self.kv_cache_dtype!r}")
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
        if options.get("fault_injection") is None and envs.FAULT_INJECTION.get():
            options["fault_injection"] = envs.FAULT_INJECTION.get()
        return cls(model=model, **options)  # type: ignore[arg-type]  # each option's value is checked in __post_init__

    def with_max_model_len(self, max_model_len: int) -> EngineConfig:
        """The config with ``max_model_len`` resolved (done once, when the model is known)."""
        return dataclasses.replace(self, max_model_len=max_model_len)

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
        return self.speculative_config  # type: ignore[return-value]  # parsed in __post_init__

    @property
    def faults(self) -> FaultSpec | None:
        return FaultSpec.parse(self.fault_injection) if self.fault_injection else None


def _int_in(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r}")


def _one_of(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
