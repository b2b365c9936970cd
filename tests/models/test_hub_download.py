"""A Hugging Face repo id that is not in the cache is downloaded from the Hub and served: here the
Hub is a local stand-in (``pagedkv_testing/hub_standin.py``) that ``huggingface_hub`` reaches through HF_ENDPOINT.
Each run is a subprocess (``huggingface_hub`` reads HF_ENDPOINT and HF_HUB_OFFLINE at import; the
test suite sets HF_HUB_OFFLINE=1 for itself, ``conftest.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv_testing.hub_standin import HubStandIn
from pagedkv_testing.tiny_model import write_tiny_model

pytest.importorskip("huggingface_hub")

REPO = "tiny-org/tiny-llama"


def _run(args: list[str], hub_url: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "HF_ENDPOINT": hub_url, "HF_HUB_OFFLINE": "0", **env})


def test_a_repo_id_is_downloaded_then_served_offline(tmp_path: Path) -> None:
    """``pagedkv generate --model ORG/NAME --download-dir DIR --revision main`` downloads the folder
    (the weights, config and tokenizer only), says so, and generates; a second run with
    HF_HUB_OFFLINE=1 loads it from DIR without asking the Hub anything."""
    folder = write_tiny_model(tmp_path / "model")
    (folder / "pytorch_model.bin").write_bytes(b"a copy of the weights nobody needs")
    downloads = tmp_path / "downloads"
    generate = ["-m", "pagedkv.cli", "generate", "--model", REPO, "--download-dir", str(downloads),
                "--prompt", "the quick brown fox", "--max-tokens", "4", "--ignore-eos"]
    with HubStandIn({REPO: folder}) as hub:
        first = _run([*generate, "--revision", "main"], hub.url)
        assert first.returncode == 0, first.stderr[-3000:]
        assert f"pagedkv: downloading {REPO} from {hub.url} into {downloads}" in first.stderr
        snapshot = downloads / "models--tiny-org--tiny-llama" / "snapshots" / hub.commit
        assert sorted(p.name for p in snapshot.iterdir()) == [
            "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
        assert first.stdout.strip()  # the completion
        asked = len(hub.requests)
        second = _run(generate, hub.url, HF_HUB_OFFLINE="1")
        assert second.returncode == 0, second.stderr[-3000:]
        assert "downloading" not in second.stderr and len(hub.requests) == asked
        assert second.stdout == first.stdout  # greedy, same weights


def test_download_failures_are_one_line(tmp_path: Path) -> None:
    """No such repo, no such revision, no network, offline and not cached: one ModelLoadError line
    each, naming the repo and what to do; ``pagedkv generate`` without a network: that one line."""
    code = (
        "import os, sys\n"
        "from pagedkv.models.loader import resolve_model_path\n"
        "def attempt(repo, revision=None, **env):\n"
        "    os.environ.update(env)\n"
        "    try:\n"
        "        resolve_model_path(repo, revision, sys.argv[1])\n"
        "    except Exception as e:\n"
        "        print(type(e).__name__, e)\n"
        f"attempt('tiny-org/nope')\n"
        f"attempt({REPO!r}, 'v9')\n"
        f"attempt({REPO!r}, HF_ENDPOINT='http://127.0.0.1:9')\n"
        f"attempt({REPO!r}, HF_HUB_OFFLINE='1')\n"
        # pagedkv generate without a network: exit status 2 and one error line (after the phase's own)
        "import contextlib, io\n"
        "from pagedkv.cli import main\n"
        "os.environ.update(HF_HUB_OFFLINE='0', HF_ENDPOINT='http://127.0.0.1:9')\n"
        "err = io.StringIO()\n"
        "with contextlib.redirect_stderr(err):\n"
        f"    code = main(['generate', '--model', {REPO!r}, '--prompt', 'hi', '--download-dir', sys.argv[1]])\n"
        "print(code, [line for line in err.getvalue().splitlines() if not line.startswith('pagedkv: ')])\n")
    with HubStandIn({REPO: write_tiny_model(tmp_path / "model")}) as hub:
        proc = _run(["-c", code, str(tmp_path / "downloads")], hub.url)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0 and len(lines) == 5, proc.stdout + proc.stderr[-3000:]
    assert all(line.startswith("ModelLoadError ") for line in lines[:4])
    assert f"'tiny-org/nope': no such model on {hub.url}" in lines[0]
    assert f"{REPO!r} has no revision 'v9' on {hub.url}" in lines[1]
    assert f"cannot download {REPO!r} from http://127.0.0.1:9: ConnectError" in lines[2] and "network" in lines[2]
    assert "HF_HUB_OFFLINE is set, so it is not downloaded" in lines[3]
    assert "Traceback" not in proc.stderr
    assert lines[4] == "2 " + repr([f"pagedkv generate: {lines[2].removeprefix('ModelLoadError ')}"])


def test_an_incomplete_cached_snapshot_is_not_loaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A snapshot whose weights never arrived (an interrupted download: the link's blob is missing)
    is completed online; offline it is an error saying so, not a load that fails later."""
    from pagedkv.models import ModelLoadError
    from pagedkv.models.hub import model_snapshot, snapshot_complete

    snapshot = tmp_path / "models--tiny-org--tiny-llama" / "snapshots" / "0123"
    folder = write_tiny_model(tmp_path / "model")
    snapshot.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json"):
        (snapshot / name).write_bytes((folder / name).read_bytes())
    (snapshot / "model.safetensors").symlink_to(tmp_path / "blobs" / "missing")
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0123")
    assert not snapshot_complete(snapshot)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match=r"is incomplete: no config.json with safetensors weights"):
        model_snapshot(REPO, download_dir=tmp_path)
    (snapshot / "model.safetensors").unlink()
    (snapshot / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    assert snapshot_complete(snapshot) and model_snapshot(REPO, download_dir=tmp_path) == snapshot
