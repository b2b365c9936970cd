"""Slow tier: the bundled SmolLM2-135M-Instruct (Q4_1 GGUF) against transformers. Run with -m slow."""

from __future__ import annotations

import pytest
import torch

from pagedkv.models import load_model
from pagedkv.models.default_model import DEFAULT_MODEL_NAME, default_model_path
from pagedkv.models.gguf_loader import converted_folder
from pagedkv.runner import ModelRunner
from pagedkv_testing.hf_checkpoints import hf_greedy, paged_greedy

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
]


@pytest.fixture(scope="module")
def default() -> object:
    return load_model(None, quantization="none")  # the file's weights exactly (dequantized), as transformers


@pytest.fixture(scope="module")
def reference(default: object) -> torch.nn.Module:
    """transformers' LlamaForCausalLM with pagedkv's dequantized weights (the cached converted folder)."""
    import transformers

    folder = converted_folder(default_model_path())
    return transformers.LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()


def test_default_model_config(default: object) -> None:
    cfg = default.config
    assert default.name == DEFAULT_MODEL_NAME
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.intermediate_size, cfg.vocab_size, cfg.tie_word_embeddings) == (576, 30, 9, 3, 1536, 49152, True)


@pytest.fixture(scope="module")
def transformers_tokens(default: object, reference: torch.nn.Module) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, transformers' 24 greedy tokens for each): PROMPTS and a chat question."""
    tok = default.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    prompts.append(tok.encode(chat))
    return prompts, [hf_greedy(reference, p, 24) for p in prompts]


def test_greedy_matches_transformers(default: object, transformers_tokens: tuple[list, list]) -> None:
    prompts, want = transformers_tokens
    runner = ModelRunner(default, block_size=16, num_blocks=64)
    got = paged_greedy(runner, prompts, 24, chunk=9)
    assert got == want
    assert "Paris" in default.tokenizer.decode(got[-1])


def test_auto_keeps_the_files_weights_quantized_and_transformers_answers(
        default: object, transformers_tokens: tuple[list, list]) -> None:
    """quantization "auto" (the default) keeps the Q4_1 weights packed at 4 bits and the Q8_0
    embedding in the 8-bit layout, exactly (Q4_1's minimum as the offset): the dequantized ("none")
    values bit for bit, and transformers' greedy tokens."""
    from pagedkv.models.quant_linear import QuantEmbedding, QuantLinear

    quant = load_model(None)
    assert quant.quantization == "auto" and isinstance(quant.model.embed_tokens, QuantEmbedding)
    assert isinstance(quant.model.lm_head, QuantLinear)  # tied: over the embedding's tensors
    ours, theirs = quant.model, default.model
    for i in (0, 17, 29):
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            mod = ours.get_submodule(f"layers.{i}.{name}")
            assert isinstance(mod, QuantLinear) and mod.offsets is not None and mod.fmt == "u4", name
            assert torch.equal(mod.weight, theirs.get_submodule(f"layers.{i}.{name}").weight), name
    assert torch.equal(ours.embed_tokens.weight, theirs.embed_tokens.weight)
    prompts, want = transformers_tokens
    got = paged_greedy(ModelRunner(quant, block_size=16, num_blocks=64), prompts, 24, chunk=9)
    assert got == want


def test_dequantized_weights_match_transformers_gguf_reader(default: object, reference: torch.nn.Module) -> None:
    """An independent dequantization + q/k un-permutation: transformers' own GGUF tensor reader."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    theirs = load_gguf_checkpoint(str(default_model_path()), return_tensors=True,
                                  model_to_load=reference)["tensors"]
    ours = default.model
    cfg = default.config
    q, kv = cfg.q_size, cfg.kv_size
    for i in (0, 17, 29):
        fused = ours.layers[i].self_attn.qkv_proj.weight
        prefix = f"model.layers.{i}.self_attn"
        torch.testing.assert_close(fused[:q], theirs[f"{prefix}.q_proj.weight"].float(), atol=1e-6, rtol=0)
        torch.testing.assert_close(fused[q:q + kv], theirs[f"{prefix}.k_proj.weight"].float(), atol=1e-6, rtol=0)
        torch.testing.assert_close(fused[q + kv:], theirs[f"{prefix}.v_proj.weight"].float(), atol=1e-6, rtol=0)
        gate_up = ours.layers[i].mlp.gate_up_proj.weight
        up = theirs[f"model.layers.{i}.mlp.up_proj.weight"].float()
        torch.testing.assert_close(gate_up[cfg.intermediate_size:], up,
                                   atol=1e-6, rtol=0)
    torch.testing.assert_close(ours.embed_tokens.weight, theirs["model.embed_tokens.weight"].float(), atol=1e-6, rtol=0)


def test_tokenizer_round_trip_and_chat_template(default: object) -> None:
    import transformers

    tok = default.tokenizer
    path = default_model_path()
    ref = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    texts = ["Hello, world!", "  leading spaces and 12345 digits", "naïve café — ünïcödé ✓ 日本語",
             "def f(x):\n\treturn x**2  # comment", "<|im_start|>user\nhi<|im_end|>\n"]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.eos_token_ids == {2} and tok.bos_token_id == 1
    messages = [{"role": "user", "content": "Hi there"}]
    rendered = tok.apply_chat_template(messages)
    assert rendered == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
                        "Face<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    assert rendered == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.encode(rendered)[0] == 1  # <|im_start|> is one special token
