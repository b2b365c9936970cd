"""Structured output: the three grammar libraries on the default model's vocabulary (49152 tokens).

For xgrammar, llguidance and outlines-core (whichever import): the time to build the tokenizer
info once, to compile a JSON schema and a regex, and the per-token cost of the mask (compute the
allowed-token bitmask, then advance by one token) along seeded random walks through each grammar
(each step picks a random allowed token, EOS only when nothing else is allowed). The cost of
applying a bitmask to a logits row is the engine's own (pagedkv.engine.structured_output), the
same for every library, and is reported once.

    .venv/bin/python bench/structured_output.py [--walks 5] [--steps 200]

To measure the libraries that pagedkv does not install, put them on PYTHONPATH, e.g.
``pip install --no-deps --target /tmp/x xgrammar apache-tvm-ffi triton``. The last line printed is
one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.(com|org)$"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "kind": {"enum": ["person", "robot", "other"]},
    },
    "required": ["name", "age", "kind"],
    "additionalProperties": False,
}
REGEX = r"[A-Z][a-z]{2,12} (19|20)[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]( #[0-9]{1,6})?"


def byte_vocab(backend) -> list[bytes]:
    """Each token id's bytes, for the libraries that take a raw vocabulary (byte-level BPE: the
    GPT-2 byte alphabet; added tokens as their text)."""
    from tokenizers import pre_tokenizers
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=ord)
    # GPT-2's order: the printable bytes map to themselves, the others to 256 + i in byte order
    printable = [b for b in range(256) if chr(b) in alphabet]
    to_byte = {chr(b): b for b in printable}
    to_byte.update({chr(256 + i): b for i, b in enumerate(b for b in range(256) if b not in printable)})
    added = {t.content for t in backend.get_added_tokens_decoder().values()}
    out = []
    for i in range(backend.get_vocab_size(with_added_tokens=True)):
        tok = backend.id_to_token(i) or ""
        out.append(tok.encode() if tok in added or any(c not in to_byte for c in tok)
                   else bytes(to_byte[c] for c in tok))
    return out


class Lib:
    """One library behind a common interface: compile(kind, spec) -> matcher factory."""

    name = ""

    def compile(self, kind: str, spec) -> Callable[[], Any]:
        raise NotImplementedError

    def mask_into(self, m, bitmask: torch.Tensor) -> None:
        raise NotImplementedError

    def advance(self, m, token: int) -> None:
        raise NotImplementedError

    def done(self, m) -> bool:
        raise NotImplementedError


class XGrammar(Lib):
    name = "xgrammar"

    def __init__(self, vocab: list[bytes], eos: list[int], n: int) -> None:
        import xgrammar as xgr
        self.xgr = xgr
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=n, stop_token_ids=eos)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)

    def compile(self, kind: str, spec):
        g = (self.compiler.compile_json_schema(json.dumps(spec), any_whitespace=False) if kind == "json"
             else self.compiler.compile_regex(spec))
        return lambda: self.xgr.GrammarMatcher(g)

    def mask_into(self, m, bitmask):
        m.fill_next_token_bitmask(bitmask)

    def advance(self, m, token):
        assert m.accept_token(token)

    def done(self, m):
        return m.is_terminated()


class LLGuidance(Lib):
    name = "llguidance"

    def __init__(self, backend, eos: list[int], n: int) -> None:
        import llguidance
        self.llg = llguidance
        self.tok = llguidance.LLTokenizer(backend.to_str(), n_vocab=n, eos_token=eos)

    def compile(self, kind: str, spec):
        M = self.llg.LLMatcher
        grammar = (M.grammar_from_json_schema(spec, defaults={"whitespace_flexible": False}) if kind == "json"
                   else M.grammar_from_regex(spec))
        return lambda: M(self.tok, grammar)

    def mask_into(self, m, bitmask):
        m.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)

    def advance(self, m, token):
        assert m.consume_token(token), m.get_error()

    def done(self, m):
        return m.is_stopped()


class OutlinesCore(Lib):
    name = "outlines-core"

    def __init__(self, vocab: list[bytes], eos: list[int], n: int) -> None:
        import outlines_core
        self.oc = outlines_core
        words: dict[bytes, list[int]] = {}
        for i, b in enumerate(vocab):
            if i not in eos and b:
                words.setdefault(b, []).append(i)
        self.vocab = outlines_core.Vocabulary(eos[0], words)

    def compile(self, kind: str, spec):
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(spec)) if kind == "json" else spec
        index = self.oc.Index(regex, self.vocab)
        return lambda: self.oc.Guide(index)

    def mask_into(self, m, bitmask):
        m.write_mask_into(bitmask.data_ptr(), bitmask.numel(), 4)

    def advance(self, m, token):
        m.advance(token)

    def done(self, m):
        return m.is_finished()


def allowed(bitmask: torch.Tensor, n: int) -> torch.Tensor:
    from pagedkv.engine.structured_output import unpack_bitmask
    return unpack_bitmask(bitmask, n).nonzero().flatten()


def walk(lib: Lib, make, eos: set[int], n: int, steps: int, seed: int,
         masks: list[torch.Tensor]) -> tuple[list[float], int]:
    """Per-token seconds (mask + advance) along one random walk, and its length; the walk's
    bitmasks are appended to ``masks``."""
    rng = random.Random(seed)
    m = make()
    bitmask = torch.zeros((n + 31) // 32, dtype=torch.int32)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        lib.mask_into(m, bitmask)
        t1 = time.perf_counter()
        masks.append(bitmask.clone())
        ids = allowed(bitmask, n).tolist()
        others = [t for t in ids if t not in eos]
        token = rng.choice(others or ids)
        t2 = time.perf_counter()
        lib.advance(m, token)
        times.append((t1 - t0) + (time.perf_counter() - t2))
        if token in eos or lib.done(m):
            break
    return times, len(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--walks", type=int, default=5)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from pagedkv.engine.structured_output import apply_bitmask
    from pagedkv.models import load_model
    tokenizer = load_model(None).tokenizer
    assert tokenizer is not None  # the default model has one
    backend, eos = tokenizer.backend, sorted(tokenizer.eos_token_ids)
    n = backend.get_vocab_size(with_added_tokens=True)
    vocab = byte_vocab(backend)
    makers = {"xgrammar": lambda: XGrammar(vocab, eos, n), "llguidance": lambda: LLGuidance(backend, eos, n),
              "outlines-core": lambda: OutlinesCore(vocab, eos, n)}
    results: dict[str, dict] = {}
    masks: list[torch.Tensor] = []  # every walk's bitmasks: the masks the engine would apply
    for name, make_lib in makers.items():
        try:
            t0 = time.perf_counter()
            lib = make_lib()
        except ImportError as exc:
            results[name] = {"error": f"not installed: {exc}"}
            continue
        r: dict = {"tokenizer_info_s": round(time.perf_counter() - t0, 3)}
        for kind, spec in (("json", SCHEMA), ("regex", REGEX)):
            t0 = time.perf_counter()
            make = lib.compile(kind, spec)
            make()
            r[f"{kind}_compile_s"] = round(time.perf_counter() - t0, 3)
            per_token, lengths = [], []
            for seed in range(args.walks):
                times, length = walk(lib, make, set(eos), n, args.steps, seed, masks)
                per_token += times
                lengths.append(length)
            r[f"{kind}_us_per_token_mean"] = round(1e6 * statistics.fmean(per_token), 1)
            r[f"{kind}_us_per_token_p50"] = round(1e6 * statistics.median(per_token), 1)
            r[f"{kind}_us_per_token_max"] = round(1e6 * max(per_token), 1)
            r[f"{kind}_tokens"] = sum(lengths)
        results[name] = r
        print(name, r, flush=True)
    logits = torch.randn(n)
    for m in masks[:20]:
        apply_bitmask(logits.clone(), m)
    t0 = time.perf_counter()
    for m in masks:
        apply_bitmask(logits.clone(), m)
    apply_us = 1e6 * (time.perf_counter() - t0) / max(len(masks), 1)  # with the copy of the row
    print(json.dumps({"bench": "structured_output", "vocab": n, "walks": args.walks, "max_steps": args.steps,
                      "apply_bitmask_us": round(apply_us, 1), "libraries": results}))


if __name__ == "__main__":
    main()
