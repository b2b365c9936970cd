"""``tokenizer=`` / ``--tokenizer`` (vLLM's): a tokenizer from a folder or a GGUF file replaces the model's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pagedkv.models import load_model
from pagedkv.models.errors import ModelLoadError
from pagedkv_testing.tiny_model import write_tiny_model

gguf = pytest.importorskip("gguf")
from test_loader_gguf import _write_gguf  # noqa: E402 - only once importorskip found gguf


def test_a_tokenizer_folder_replaces_the_models(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "model")
    other = tmp_path / "tok"
    other.mkdir()
    shutil.copy(model / "tokenizer.json", other / "tokenizer.json")
    (other / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False,
        "chat_template": "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"}))
    own = load_model(str(model)).tokenizer
    loaded = load_model(str(model), tokenizer=str(other))
    assert loaded.tokenizer.render_chat([{"role": "user", "content": "hi"}], add_generation_prompt=False) == "<<hi>>"
    # the replacement's tokenizer_config (no BOS added) rules, not the model's (BOS added)
    assert own.encode("hello")[0] == own.bos_token_id
    assert loaded.tokenizer.encode("hello") == own.encode("hello")[1:]


def test_a_gguf_files_tokenizer_is_read_without_its_tensors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tok.gguf"
    _write_gguf(path, True, gguf.GGMLQuantizationType.F32)
    own = load_model(str(path)).tokenizer
    loaded = load_model(str(path), tokenizer=str(path)).tokenizer
    text = "hello world 42<|im_end|>"
    assert loaded.encode(text) == own.encode(text) and loaded.eos_token_ids == own.eos_token_ids
    assert loaded.chat_template == own.chat_template
    (folder,) = (tmp_path / "cache" / "gguf-tokenizer").iterdir()
    assert (folder / "tokenizer.json").exists() and not list(folder.glob("*.safetensors"))


def test_a_tokenizer_that_cannot_serve_the_model_is_refused(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models

    model = write_tiny_model(tmp_path / "model")
    vocab_size = json.loads((model / "config.json").read_text())["vocab_size"]
    big = tmp_path / "big"
    big.mkdir()
    Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size + 10)}, unk_token="w0")).save(
        str(big / "tokenizer.json"))
    with pytest.raises(ModelLoadError, match=rf"vocabulary \({vocab_size + 10} tokens\) is larger"):
        load_model(str(model), tokenizer=str(big))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        load_model(str(model), tokenizer=str(empty))
    with pytest.raises(ModelLoadError, match="HF_HUB_OFFLINE is set, so it is not downloaded"):
        load_model(str(model), tokenizer="no-such-org/no-such-tokenizer")


def test_serve_takes_the_tokenizer_flag() -> None:
    import argparse

    from pagedkv.engine.flags import engine_options
    from pagedkv.server.cli import add_serve_arguments

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert engine_options(parser.parse_args(["m", "--tokenizer", "/tok"]))["tokenizer"] == "/tok"


def test_kv_cache_memory_bytes_is_vllms_spelling() -> None:
    import argparse

    from pagedkv.engine.flags import add_engine_arguments, engine_options
    from pagedkv.runner.kv_cache import parse_memory_size

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    options = engine_options(parser.parse_args(["--kv-cache-memory-bytes", "4G"]))
    assert options == {"kv_cache_memory": "4G"}
    assert parse_memory_size(options["kv_cache_memory"]) == 4 * 2**30
