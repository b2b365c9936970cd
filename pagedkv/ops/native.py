"""Native CPU kernels (C++), built once per machine with PyTorch's extension tooling.

``available()`` builds ``csrc/*.cpp`` on first use (about a minute; ``scripts/setup.sh``
does it ahead of time) into ``$PAGEDKV_CACHE_DIR/native/`` (default ``~/.cache/pagedkv/native``),
keyed by the source, the torch version and the CPU's instruction sets (it is built with
``-march=native``; a first build says so on stderr: ``pagedkv/progress.py``), and registers
``torch.ops.pagedkv.paged_attention`` and ``torch.ops.pagedkv.rms_norm`` (and, from
``csrc/quant_matmul.cpp``, ``q8_0_linear``: a linear layer over GGUF Q8_0 weights kept as int8;
from ``csrc/lowbit_matmul.cpp``, ``lowbit_linear``: over GGUF's 4-, 5- and 6-bit types kept packed).
Where no compiler is present or the build fails, ``available()`` is False, the reason is logged
once, and callers use the plain PyTorch ops. ``PAGEDKV_NATIVE=0`` turns the native path off.

    python -m pagedkv.ops.native    build now and say whether it works
"""

from __future__ import annotations

import hashlib
import logging
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from pagedkv import envs
from pagedkv.paths import cache_root
from pagedkv.progress import phase

logger = logging.getLogger(__name__)

_SOURCES = [Path(__file__).parent / "csrc" / "paged_attention.cpp", Path(__file__).parent / "csrc" / "quant_matmul.cpp"]
_SOURCES.append(Path(__file__).parent / "csrc" / "fused_ops.cpp")  # rope_qk, silu_mul, add_rms_norm (ops/fused.py)
_SOURCES.append(Path(__file__).parent / "csrc" / "cascade_attention.cpp")  # shared-block attention (ops/cascade.py)
_SOURCES.append(Path(__file__).parent / "csrc" / "lowbit_matmul.cpp")  # lowbit_linear: 4/5/6-bit GGUF weights
_SOURCES.append(Path(__file__).parent / "csrc" / "decoder_layer.cpp")  # decoder_layer (models/native_layer.py)
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno"]
_lock = threading.Lock()
_state: dict[str, object] = {}


def _headers() -> list[Path]:
    """The headers the sources include (``csrc/*.h``, e.g. ``gemv_common.h``): part of the build key."""
    return sorted((Path(__file__).parent / "csrc").glob("*.h"))


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


def _build_key() -> str:
    h = hashlib.sha256()
    for src in [*_SOURCES, *_headers()]:  # a header change rebuilds too
        h.update(src.read_bytes())
    h.update(" ".join(_FLAGS).encode())
    h.update(torch.__version__.encode())
    h.update(_cpu_flags().encode())
    # The sources' folder too: PyTorch's build file names the sources by absolute path, so two
    # checkouts sharing one cache would each find the other's build file and rebuild, in turn.
    h.update(str(_SOURCES[0].parent.resolve()).encode())
    return h.hexdigest()[:16]


def _build(verbose: bool = False) -> None:
    from torch.utils import cpp_extension
    key = _build_key()
    folder = cache_root() / "native" / key
    folder.mkdir(parents=True, exist_ok=True)
    with _exclusive(folder / "pagedkv-build.lock") as held:
        # PyTorch marks a build in progress with a "lock" file and waits, for ever, while it
        # exists; a process killed inside load() leaves it behind. Under our lock (the kernel
        # drops it with its process) no other pagedkv process is inside load(): any such file
        # is stale.
        if held:
            (folder / "lock").unlink(missing_ok=True)
        name = f"pagedkv_native_{key}"
        if not _needs_build(folder / f"{name}.so"):  # built before (this machine, this torch): a load
            _load(cpp_extension, name, folder, verbose)
            return
        # A first build compiles for one to three minutes: say so, or a first start looks hung.
        with phase(f"building the native CPU kernels once for this machine into {folder} "
                   "(one to three minutes; later starts reuse them)", done="built"):
            _load(cpp_extension, name, folder, verbose)


def _needs_build(library: Path) -> bool:
    """Whether loading will compile: no library yet, or a source newer than it (ninja's rule)."""
    try:
        built = library.stat().st_mtime_ns
    except OSError:
        return True
    return any(src.stat().st_mtime_ns > built for src in [*_SOURCES, *_headers()])


def _load(cpp_extension, name: str, folder: Path, verbose: bool) -> None:
    cpp_extension.load(name=name, sources=[str(s) for s in _SOURCES], extra_cflags=_FLAGS,
                       extra_ldflags=["-fopenmp"], build_directory=str(folder), is_python_module=False,
                       verbose=verbose)


@contextmanager
def _exclusive(path: Path) -> Iterator[bool]:
    """Hold an exclusive lock on ``path`` (waits for other processes; released when this one
    dies); yields False where there is no such lock (not POSIX)."""
    try:
        import fcntl
    except ImportError:
        yield False
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def available() -> bool:
    """Whether ``torch.ops.pagedkv.paged_attention`` is usable (builds it on first call)."""
    if "ok" in _state:
        return bool(_state["ok"])
    with _lock:
        if "ok" not in _state:
            if not envs.NATIVE.get():
                _state["ok"], _state["why"] = False, "PAGEDKV_NATIVE=0"
            else:
                try:
                    _build()
                    _state["ok"] = True
                except Exception as exc:  # noqa: BLE001 - no compiler, failed build: use the fallback
                    _state["ok"], _state["why"] = False, f"{type(exc).__name__}: {exc}"
                    logger.warning("native CPU kernels unavailable, using plain PyTorch attention (%s)",
                                   str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    return bool(_state["ok"])


def why_unavailable() -> str | None:
    return None if available() else str(_state.get("why"))


def main() -> int:
    ok = available()
    print("native CPU kernels: " + ("built and loaded" if ok else f"unavailable ({why_unavailable()})"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
