"""Damaged GGUF files are named and explained in one line: a truncated file (expected and actual
size), a file missing a metadata key (the key), a file that is no GGUF (its first bytes); through
``load_model`` and through ``pagedkv generate`` (exit status 2, no traceback)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pagedkv.models import ModelLoadError, load_model
from pagedkv.models.gguf_file import GGUFFileError, open_gguf

gguf = pytest.importorskip("gguf")

HIDDEN, LAYERS, VOCAB = 32, 1, 16


def write_gguf(path: Path, *, skip_key: str | None = None) -> Path:
    """A tiny llama GGUF (random F32 weights, a 16-token vocabulary); ``skip_key`` leaves one
    metadata key out."""
    w = gguf.GGUFWriter(str(path), "llama")
    keys = {"llama.context_length": 64, "llama.embedding_length": HIDDEN, "llama.block_count": LAYERS,
            "llama.feed_forward_length": 64, "llama.attention.head_count": 4,
            "llama.attention.head_count_kv": 2}
    for key, value in keys.items():
        if key != skip_key:
            w.add_uint32(key, value)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(VOCAB)])
    w.add_token_types([1] * VOCAB)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        shapes |= {f"blk.{i}.attn_norm.weight": (HIDDEN,), f"blk.{i}.ffn_norm.weight": (HIDDEN,),
                   f"blk.{i}.attn_q.weight": (HIDDEN, HIDDEN), f"blk.{i}.attn_k.weight": (16, HIDDEN),
                   f"blk.{i}.attn_v.weight": (16, HIDDEN), f"blk.{i}.attn_output.weight": (HIDDEN, HIDDEN),
                   f"blk.{i}.ffn_gate.weight": (64, HIDDEN), f"blk.{i}.ffn_up.weight": (64, HIDDEN),
                   f"blk.{i}.ffn_down.weight": (HIDDEN, 64)}
    for name, shape in shapes.items():
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))


def test_a_good_file_loads(tmp_path: Path) -> None:
    loaded = load_model(str(write_gguf(tmp_path / "good.gguf")))
    assert loaded.config.hidden_size == HIDDEN and loaded.tokenizer is not None


def test_truncated_file_names_expected_and_actual_size(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "cut.gguf")
    full = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(full - 1000)
    with pytest.raises(GGUFFileError) as info:
        load_model(str(path))
    message = str(info.value)
    assert message.startswith(f"{path} is truncated: its tensors need ") and "\n" not in message
    needed = int(message.split("need ")[1].split(" bytes")[0].replace(",", ""))
    assert full - 1000 < needed <= full and f"the file has {full - 1000:,}" in message
    assert "again" in message


def test_header_cut_short(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "head.gguf")
    with open(path, "r+b") as f:
        f.truncate(200)
    with pytest.raises(GGUFFileError, match=r"head\.gguf is truncated inside its header: the file has 200 bytes"):
        open_gguf(path)


@pytest.mark.parametrize("key", ["llama.embedding_length", "llama.block_count", "llama.attention.head_count"])
def test_missing_key_is_named(tmp_path: Path, key: str) -> None:
    path = write_gguf(tmp_path / "nokey.gguf", skip_key=key)
    with pytest.raises(ModelLoadError) as info:
        load_model(str(path))
    assert str(info.value).startswith(f"{path}: the GGUF metadata lacks '{key}', which a llama model needs")


def test_bad_magic_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "page.gguf"
    path.write_bytes(b"<!DOCTYPE html><html>Not found</html>")
    with pytest.raises(GGUFFileError) as info:
        load_model(str(path))
    assert str(info.value).startswith(f"{path} is not a GGUF file: it starts with b'<!DO'")
    path.write_bytes(b"")
    with pytest.raises(GGUFFileError, match="it is empty"):
        load_model(str(path))


@pytest.mark.parametrize("damage", ["truncated", "missing-key", "bad-magic"])
def test_generate_prints_one_line(tmp_path: Path, damage: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``pagedkv generate`` on each damaged file: exit status 2, one line on stderr naming the file."""
    from pagedkv.cli import main

    path = tmp_path / "m.gguf"
    if damage == "bad-magic":
        path.write_bytes(b"PK\x03\x04 a zip, not a GGUF")
    else:
        write_gguf(path, skip_key="llama.block_count" if damage == "missing-key" else None)
    if damage == "truncated":
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size // 2)
    assert main(["generate", "--model", str(path), "--prompt", "hi"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and captured.out == "", captured.err
    assert lines[0].startswith(f"pagedkv generate: {path}")
    assert {"truncated": "is truncated", "missing-key": "lacks 'llama.block_count'",
            "bad-magic": "is not a GGUF file"}[damage] in lines[0]
