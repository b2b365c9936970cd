"""The Python API: ``LLM`` and ``SamplingParams``, shaped like vLLM's offline interface.

    from pagedkv import LLM, SamplingParams
    llm = LLM()                                   # the bundled SmolLM2-135M-Instruct
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16))
    print(out[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from typing import cast

from pagedkv.engine import EngineStats, LLMEngine
from pagedkv.lora.request import LoRARequest
from pagedkv.outputs import RequestOutput
from pagedkv.progress import interactive
from pagedkv.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """An engine plus a tokenizer, for offline batched generation.

    ``model``: a Hugging Face folder, a ``.gguf`` file, or None for the bundled default model.
    Engine options keep vLLM's names (``block_size``, ``enable_prefix_caching``,
    ``kv_cache_memory`` / ``num_kv_blocks``, ``kv_offloading_size`` (``swap_space``), ``kv_offload_dir``,
    ``kv_offload_disk_size``, ``max_num_seqs``,
    ``max_num_batched_tokens``, ``max_model_len``, ``preemption_mode``, ``eviction_policy``,
    ``dtype``, ``quantization``, ``seed``, ``fault_injection``, ``debug_integrity``, ``threads``,
    ``generation_config``, ``tokenizer``, ``enable_lora``, ``max_loras``, ``max_lora_rank``,
    ``max_cpu_loras``); see ``pagedkv.engine.EngineConfig``. With ``enable_lora``, ``generate`` and
    ``chat`` take ``lora_request``: one ``LoRARequest`` for every prompt, or a list with one per
    prompt (None: the base model).
    """

    def __init__(self, model: str | None = None, **engine_options) -> None:
        self.engine = LLMEngine.from_options(model, **engine_options)
        self._ids = itertools.count()
        # A clean shutdown (the disk tier written down) when this object goes away, at the
        # latest when the interpreter exits.
        self._finalizer = weakref.finalize(self, self.engine.close)

    def close(self) -> None:
        """Shut the engine down cleanly now (see ``LLMEngine.close``); also done at exit."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams ``generate`` and ``chat`` use when given none: the model's
        generation_config.json defaults (``generation_config`` option, as vLLM's), else SamplingParams()."""
        return SamplingParams(**self.engine.generation_defaults)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool | None = None, cache_salt: str | None = None,
                 priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (strings or token-id lists); outputs keep the prompts' order.

        A prompt the engine rejects raises before any request runs (all are validated first).
        ``use_tqdm`` (vLLM's): a "Processed prompts" progress bar on stderr; None (default) shows it
        when stderr is a terminal.
        """
        prompts = _as_prompt_list(prompts)
        params = _per_prompt(sampling_params or self.get_default_sampling_params(), len(prompts), "sampling_params")
        prios = list(priority) if priority is not None else [0] * len(prompts)
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        loras = _per_prompt_lora(lora_request, len(prompts))
        self.engine.add_requests(list(zip(ids, prompts, params)), cache_salt=cache_salt,
                                 priorities=prios, lora_requests=loras)
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict] | Sequence[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             use_tqdm: bool | None = None, add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} messages) or to
        a list of conversations, using the model's chat template (``Tokenizer.encode_chat``, the
        server's path too)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.engine.tokenizer
        prompts = [tok.encode_chat(c, add_generation_prompt, continue_final_message=continue_final_message,
                                   chat_template_kwargs=chat_template_kwargs) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def beam_search(self, prompts: Prompt | Sequence[Prompt], beam_width: int, max_tokens: int, *,
                    length_penalty: float = 1.0, ignore_eos: bool = False) -> list[RequestOutput]:
        """Native beam search: beams are forks sharing the prompt's blocks (copy-on-write).

        Each output holds the ``beam_width`` best hypotheses, best first, with their
        ``cumulative_logprob``; see ``pagedkv.engine.beam_search`` for the exact rule.
        """
        prompts = _as_prompt_list(prompts)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
        ids = [f"beam-{next(self._ids)}" for _ in prompts]
        for rid, prompt in zip(ids, prompts):
            self.engine.add_request(rid, prompt, params, beam_width=beam_width,
                                    length_penalty=length_penalty)
        return self._run(ids, False)

    def stats(self) -> EngineStats:
        """KV figures of the memory core plus scheduler counters."""
        return self.engine.stats()

    def _run(self, ids: list[str], use_tqdm: bool | None) -> list[RequestOutput]:
        wanted = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = _ProgressBar(len(ids)) if (interactive() if use_tqdm is None else use_tqdm) else None
        try:
            while len(done) < len(ids):
                for out in self.engine.step(only_finished=True):
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.finished(out)
                if not self.engine.has_unfinished_requests() and len(done) < len(ids):
                    raise RuntimeError("the engine lost requests: " + str(sorted(wanted - set(done))))
        except BaseException:
            for rid in wanted - set(done):
                self.engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]


class _ProgressBar:
    """vLLM's "Processed prompts" bar: finished prompts, with the input and output token rates."""

    def __init__(self, total: int) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc="Processed prompts", unit="prompt", dynamic_ncols=True)
        self.tokens_in = self.tokens_out = 0

    def finished(self, out: RequestOutput) -> None:
        self.tokens_in += len(out.prompt_token_ids)
        self.tokens_out += sum(len(c.token_ids) for c in out.outputs)
        elapsed = self.bar.format_dict["elapsed"] or 1e-9
        self.bar.set_postfix_str(f"est. speed input: {self.tokens_in / elapsed:.2f} toks/s, "
                                 f"output: {self.tokens_out / elapsed:.2f} toks/s", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [cast(list[int], items)]  # one prompt of token ids
    return cast(list[Prompt], items)


def _per_prompt_lora(value, n: int) -> list | None:
    """``lora_request`` as one entry per prompt (None when no prompt uses an adapter)."""
    if value is None:
        return None
    if isinstance(value, LoRARequest):
        return [value] * n
    value = list(value)
    if len(value) != n:
        raise ValueError(f"lora_request has {len(value)} entries for {n} prompts")
    return value


def _per_prompt(value, n: int, name: str) -> list:
    if isinstance(value, SamplingParams):
        return [value] * n
    value = list(value)
    if len(value) != n:
        raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
    return value
