"""Every environment variable pagedkv reads: its name, meaning, default and type, in one table.

Code reads a variable through its entry here (``envs.CACHE_DIR.get()``), never through
``os.environ``, so that this table is the whole list: ``docs/environment.md`` shows it (generated from
``markdown_table()``; a test keeps it in sync), and ``tests/test_envs.py`` checks that no other
module of the package reads the environment.

A variable is read when asked for, not at import: tests and ``pagedkv serve`` set some after
pagedkv is imported. An empty value counts as unset (``VAR= cmd`` means "not set"). Where pagedkv
honours vLLM's (or another tool's) name for the same setting, that name is an alias, read when
pagedkv's own name is unset. A value that does not parse raises ValueError naming the variable.

Variables only the tests read (``PAGEDKV_TEST_DEVICE``, ``PAGEDKV_SLOW`` ...) are not here (the
package never reads them); ``docs/environment.md`` lists them too.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class EnvVar(Generic[T]):
    """One environment variable. ``get()`` is its parsed value, or ``default`` when unset."""

    name: str
    kind: str  # what the value is, for the docs table: "path", "flag", "seconds", "text", ...
    default: T
    meaning: str
    parse: Callable[[str], T]
    aliases: tuple[str, ...] = ()  # other tools' names for the same setting, read after ``name``

    def get(self) -> T:
        for name in (self.name, *self.aliases):
            value = os.environ.get(name)
            if value:
                try:
                    return self.parse(value)
                except ValueError as exc:
                    raise ValueError(f"environment variable {name}: {exc}") from None
        return self.default


def _text(value: str) -> str:
    return value


def _path(value: str) -> Path:
    return Path(value).expanduser()


def _yes(value: str) -> bool:
    """1, true, yes or on (any case): how vLLM and huggingface_hub read their switches."""
    return value.strip().lower() in ("1", "true", "yes", "on")


def _not_zero(value: str) -> bool:
    return value != "0"


def _is_one(value: str) -> bool:
    return value == "1"


def _index(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"must be an integer, got {value!r}") from None
    if number < 0:
        raise ValueError(f"must be >= 0, got {number}")
    return number


def _seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"must be a number of seconds, got {value!r}") from None
    if seconds <= 0:
        raise ValueError(f"must be > 0, got {seconds}")
    return seconds


# -- files ----------------------------------------------------------------------------------------

CACHE_DIR: EnvVar[Path | None] = EnvVar(
    "PAGEDKV_CACHE_DIR", "path", None,
    "pagedkv's cache folder: converted GGUF models, the native kernels' build, verified downloads "
    "(unset: $XDG_CACHE_HOME/pagedkv, else ~/.cache/pagedkv; see pagedkv/paths.py)", _path)
XDG_CACHE_HOME: EnvVar[Path | None] = EnvVar(
    "XDG_CACHE_HOME", "path", None,
    "the user's cache folder (freedesktop.org); pagedkv's and Hugging Face's caches go under it "
    "when their own variables are unset (unset: ~/.cache)", _path)

# -- Hugging Face (huggingface_hub's names and meanings) -----------------------------------------

HF_HUB_CACHE: EnvVar[Path | None] = EnvVar(
    "HF_HUB_CACHE", "path", None,
    "where downloaded Hugging Face models are kept (unset: $HF_HOME/hub)", _path)
HF_HOME: EnvVar[Path | None] = EnvVar(
    "HF_HOME", "path", None,
    "Hugging Face's home folder (unset: $XDG_CACHE_HOME/huggingface, else ~/.cache/huggingface)", _path)
HF_HUB_OFFLINE: EnvVar[bool] = EnvVar(
    "HF_HUB_OFFLINE", "flag", False,
    "never download: a model id must already be in the Hugging Face cache (the tests set it)", _yes)
HF_ENDPOINT: EnvVar[str | None] = EnvVar(
    "HF_ENDPOINT", "URL", None,
    "the Hub to download from (unset: huggingface_hub's default, https://huggingface.co)", _text)

# -- kernels and devices ----------------------------------------------------------------------------

NATIVE: EnvVar[bool] = EnvVar(
    "PAGEDKV_NATIVE", "flag", True,
    "0: never build or use the C++ kernels (ops/csrc); the plain PyTorch ops run instead", _not_zero)
ATTENTION: EnvVar[str | None] = EnvVar(
    "PAGEDKV_ATTENTION", "native, plain or triton", None,
    "the attention backend when the engine is not given one (unset: triton on CUDA, native on CPU "
    "where it builds, else plain)", _text)
TRITON_INTERPRET: EnvVar[bool] = EnvVar(
    "TRITON_INTERPRET", "flag (1)", False,
    "Triton's own switch: 1 runs Triton kernels in its interpreter, on CPU tensors (how the tests run "
    "the GPU kernels without a GPU); set it before triton is imported", _is_one)

# -- engine ---------------------------------------------------------------------------------------

FAULT_INJECTION: EnvVar[str | None] = EnvVar(
    "PAGEDKV_FAULT_INJECTION", "fault spec", None,
    "fault injection when EngineConfig.fault_injection is not given, e.g. \"seed=7,rate=0.05\" "
    "(engine/faults.py; for chaos tests)", _text)
QUIET: EnvVar[bool] = EnvVar(
    "PAGEDKV_QUIET", "flag", False,
    "anything but 0: no progress lines on stderr for long start-up phases (progress.py)", _not_zero)

# -- tensor parallelism (docs/tensor_parallel.md) ---------------------------------------------------

TP_TIMEOUT_S: EnvVar[float] = EnvVar(
    "PAGEDKV_TP_TIMEOUT_S", "seconds", 60.0,
    "the longest one tensor-parallel collective (a step plan, an all-reduce) waits for a rank: past it "
    "the rank is taken as hung and the engine stops with an error naming it", _seconds)
TP_SHM: EnvVar[bool] = EnvVar(
    "PAGEDKV_TP_SHM", "flag", True,
    "0: CPU tensor-parallel ranks sum through gloo only, not through shared memory "
    "(pagedkv/distributed/shm.py)", _not_zero)
TORCH_RANK: EnvVar[int | None] = EnvVar(
    "RANK", "integer", None,
    "torchrun's rank of this process: with WORLD_SIZE > 1, rank 0 runs the engine and the others the "
    "tensor-parallel worker loop (pagedkv/distributed/launch.py)", _index)
TORCH_WORLD_SIZE: EnvVar[int | None] = EnvVar(
    "WORLD_SIZE", "integer", None,
    "torchrun's number of processes: the tensor-parallel size of a torchrun launch", _index)
TORCH_LOCAL_RANK: EnvVar[int | None] = EnvVar(
    "LOCAL_RANK", "integer", None,
    "torchrun's rank on this host: the GPU (cuda:LOCAL_RANK) a rank of a torchrun launch uses", _index)

# -- server ---------------------------------------------------------------------------------------

API_KEY: EnvVar[str | None] = EnvVar(
    "PAGEDKV_API_KEY", "text", None,
    "the API key `pagedkv serve` requires when --api-key is not given", _text)
METRICS_API_KEY: EnvVar[str | None] = EnvVar(
    "PAGEDKV_METRICS_API_KEY", "text", None,
    "the key /metrics requires when --metrics-api-key is not given (unset: /metrics is open)", _text)
LOG_STATS_INTERVAL: EnvVar[float] = EnvVar(
    "PAGEDKV_LOG_STATS_INTERVAL", "seconds", 10.0,
    "seconds between the server's periodic stats lines (vLLM's default, 10)", _seconds,
    aliases=("VLLM_LOG_STATS_INTERVAL",))
ALLOW_LONG_MAX_MODEL_LEN: EnvVar[bool] = EnvVar(
    "PAGEDKV_ALLOW_LONG_MAX_MODEL_LEN", "flag", False,
    "accept a --max-model-len beyond the model's max_position_embeddings (vLLM's rule and name)", _yes,
    aliases=("VLLM_ALLOW_LONG_MAX_MODEL_LEN",))
ALLOW_RUNTIME_LORA_UPDATING: EnvVar[bool] = EnvVar(
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "flag", False,
    "serve /v1/load_lora_adapter and /v1/unload_lora_adapter, as --allow-runtime-lora-updating does "
    "(vLLM's name)", _yes)

ALL: tuple[EnvVar, ...] = (
    CACHE_DIR, XDG_CACHE_HOME, HF_HUB_CACHE, HF_HOME, HF_HUB_OFFLINE, HF_ENDPOINT, NATIVE, ATTENTION,
    TRITON_INTERPRET, FAULT_INJECTION, QUIET, API_KEY, METRICS_API_KEY, LOG_STATS_INTERVAL,
    ALLOW_LONG_MAX_MODEL_LEN, ALLOW_RUNTIME_LORA_UPDATING, TP_TIMEOUT_S, TP_SHM, TORCH_RANK, TORCH_WORLD_SIZE,
    TORCH_LOCAL_RANK,
)


def markdown_table() -> str:
    """The table of ``ALL`` in docs/environment.md (a test keeps the doc in sync with it)."""
    rows = ["| variable | type | default | meaning |", "|---|---|---|---|"]
    for var in ALL:
        names = " or ".join(f"`{n}`" for n in (var.name, *var.aliases))
        if var.default is None:
            default = "unset"
        elif isinstance(var.default, bool):
            default = "on" if var.default else "off"
        else:
            default = f"`{var.default}`"
        rows.append(f"| {names} | {var.kind} | {default} | {var.meaning} |")
    return "\n".join(rows) + "\n"
