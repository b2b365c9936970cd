"""Models named by a Hugging Face repo id (``org/name``): the local Hugging Face cache first, else a
download from the Hub with ``huggingface_hub`` (vLLM's behaviour).

- the cache is ``download_dir`` when given (vLLM's ``--download-dir``), else Hugging Face's own
  (``$HF_HUB_CACHE``, ``$HF_HOME/hub``, ``~/.cache/huggingface/hub``);
- ``revision`` is a branch, a tag or a commit (default "main"), in the cache and on the Hub;
- ``HF_HUB_OFFLINE=1`` never touches the network: a model not in the cache is an error saying so;
- a cached snapshot without config.json and safetensors (an interrupted download) is completed;
- ``HF_ENDPOINT`` points at another Hub (a mirror; the tests' local stand-in);
- what is fetched is what the loader reads (config and tokenizer JSON, safetensors, a chat
  template), never ``*.bin`` / ``*.pt`` / ``*.gguf`` copies of the same weights; the Hub's progress
  bars show the bytes;
- a failure (no network, no such repo or revision, a gated or private repo) is one
  :class:`~pagedkv.models.errors.ModelLoadError` line naming the repo and what to do.
"""

from __future__ import annotations

from pathlib import Path

from pagedkv import envs
from pagedkv.models.errors import ModelLoadError
from pagedkv.progress import phase

# The files of a repo that loading an HF folder reads (models/hf_loader.py).
DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.jinja"]


def hf_hub_cache() -> Path:
    """Where Hugging Face keeps downloaded models: $HF_HUB_CACHE, else $HF_HOME/hub, else
    ~/.cache/huggingface/hub."""
    cache = envs.HF_HUB_CACHE.get()
    if cache is not None:
        return cache
    home = envs.HF_HOME.get()
    if home is None:
        home = (envs.XDG_CACHE_HOME.get() or Path("~/.cache").expanduser()) / "huggingface"
    return home / "hub"


def hf_cache_snapshot(repo_id: str, revision: str = "main", cache: Path | None = None) -> Path | None:
    """The snapshot folder of ``repo_id`` (``org/name``) in the Hugging Face cache ``cache``
    (default :func:`hf_hub_cache`) at ``revision`` (a branch or tag named in refs/, or a commit
    hash), or None. No network."""
    root = (cache or hf_hub_cache()) / ("models--" + repo_id.replace("/", "--"))
    ref = root / "refs" / revision
    try:
        commit = ref.read_text().strip() if ref.is_file() else revision
    except OSError:
        return None
    snapshot = root / "snapshots" / commit
    if snapshot.is_dir():
        return snapshot
    snapshots = sorted((root / "snapshots").glob("*"), key=lambda p: p.stat().st_mtime) if root.is_dir() else []
    return snapshots[-1] if snapshots and not ref.is_file() and revision == "main" else None


def snapshot_complete(folder: Path) -> bool:
    """Whether a cached snapshot holds what loading reads: config.json and safetensors weights, or
    one GGUF file (links into the cache's blobs count only when their blob is there)."""
    files = [p for p in folder.iterdir() if p.is_file()] if folder.is_dir() else []
    names = {p.name for p in files}
    if "config.json" in names:
        return any(name.endswith(".safetensors") for name in names)
    return sum(name.endswith(".gguf") for name in names) == 1


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` forbids the network (read now, not at import)."""
    return envs.HF_HUB_OFFLINE.get()


def looks_like_repo_id(text: str) -> bool:
    parts = text.split("/")
    return len(parts) == 2 and all(p and not p.startswith(".") for p in parts) and not text.endswith(".gguf")


def model_snapshot(repo_id: str, revision: str | None = None, download_dir: str | Path | None = None) -> Path:
    """The local folder of ``repo_id`` at ``revision``: the cached snapshot, else downloaded into
    the cache (see the module docstring). Raises ModelLoadError with one line."""
    revision = revision or "main"
    cache = Path(download_dir).expanduser() if download_dir else hf_hub_cache()
    cached = hf_cache_snapshot(repo_id, revision, cache)
    if cached is not None and snapshot_complete(cached):
        return cached
    at = "" if revision == "main" else f" at revision {revision!r}"
    if hub_offline() and cached is not None:  # online, the download below completes it
        raise ModelLoadError(f"{repo_id!r}{at} in the Hugging Face cache ({cached}) is incomplete: no config.json "
                             "with safetensors weights (an interrupted download?), and HF_HUB_OFFLINE is set, so "
                             "it is not downloaded again: unset HF_HUB_OFFLINE, or give a complete folder")
    if hub_offline():
        raise ModelLoadError(f"{repo_id!r}{at} is neither a local path nor in the Hugging Face cache ({cache}), "
                             "and HF_HUB_OFFLINE is set, so it is not downloaded: unset HF_HUB_OFFLINE, or "
                             "give a folder or a .gguf file")
    try:
        import huggingface_hub
        from huggingface_hub import constants, errors
    except ImportError as e:
        raise ModelLoadError(f"{repo_id!r} is not in the Hugging Face cache ({cache}) and huggingface_hub, "
                             "which downloads it, is not installed: pip install huggingface_hub") from e
    endpoint = envs.HF_ENDPOINT.get() or constants.ENDPOINT
    try:
        with phase(f"downloading {repo_id}{at} from {endpoint} into {cache}", done="downloaded"):
            folder = huggingface_hub.snapshot_download(repo_id, revision=revision, cache_dir=str(cache),
                                                       allow_patterns=DOWNLOAD_PATTERNS, endpoint=endpoint)
    except errors.RevisionNotFoundError as e:
        raise ModelLoadError(f"{repo_id!r} has no revision {revision!r} on {endpoint}: give a branch, a tag "
                             "or a commit it has (--revision)") from e
    except errors.GatedRepoError as e:
        raise ModelLoadError(f"{repo_id!r} is gated on {endpoint}: accept its terms on its page there and set "
                             "HF_TOKEN (or log in with `hf auth login`)") from e
    except errors.RepositoryNotFoundError as e:
        raise ModelLoadError(f"{repo_id!r}: no such model on {endpoint}, or a private one (set HF_TOKEN, or "
                             "log in with `hf auth login`)") from e
    except Exception as e:  # network, disk, the Hub's errors: one line, never a traceback
        reason = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__).removeprefix("Got: ")
        raise ModelLoadError(f"cannot download {repo_id!r}{at} from {endpoint}: {reason} (check the network "
                             "or the proxy settings; or download it elsewhere and give its folder)") from e
    return Path(folder)


__all__ = ["DOWNLOAD_PATTERNS", "hf_cache_snapshot", "hf_hub_cache", "hub_offline", "looks_like_repo_id",
           "model_snapshot", "snapshot_complete"]
