"""The draft-model proposer: a smaller model with the target's tokenizer guesses k tokens.

The draft has a paged KV cache of its own, managed by a ``KVCacheManager`` of its own (block
tables, prefix caching with the request's salt, rollback), beside the target's. Its cache is
only ever a cache: a sequence it cannot hold is simply not proposed for, and any failure drops
its state; the target's verification decides every emitted token.

Each call (after an engine step):

1. settle: of the proposals written into the draft's cache last time (positions past its
   computed tokens), those the target accepted are marked computed, the rest rolled back;
2. catch up: one batched pass over every sequence's tokens the draft has not seen yet (a
   prompt, or the target's own token after a rejection) gives its first proposal;
3. k - 1 batched single-token passes give the rest. Proposals are the draft's argmax (a point
   mass, which ``sampling/rejection.py``'s rejection sampling expects).

A sequence whose catch-up exceeds the pass's token budget (a long new prompt) catches up over
several calls and gets proposals once it has.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from pagedkv.memory import KVCacheManager, OutOfBlocksError
from pagedkv.runner.batch import SeqChunk

logger = logging.getLogger(__name__)


class DraftModelProposer:
    def __init__(self, runner, kv: KVCacheManager, max_pass_tokens: int, target_vocab_size: int) -> None:
        self.runner = runner
        self.kv = kv
        self.max_pass_tokens = max_pass_tokens
        self.vocab = target_vocab_size
        self.pending: dict[str, tuple[int, list[int]]] = {}  # seq_id -> (position of proposal 0, proposals)
        self.lists: dict[str, list[int]] = {}  # seq_id -> the token list it was registered with
        self.failures = 0

    def propose(self, wanted, live: set[str]) -> dict[str, list[int]]:
        """Proposals for ``wanted`` ((group, seq, k) triples); sequences not in ``live`` (the
        running sequences' ids) are dropped from the draft's cache first."""
        for sid in [s for s in self.lists if s not in live]:
            self._drop(sid)
        try:
            return self._propose(wanted)
        except Exception:  # the draft is a cache: forget it, the target goes on
            self.failures += 1
            logger.exception("the draft model failed; its cache is reset and this step proposes nothing")
            for sid in list(self.lists):
                self._drop(sid)
            return {}

    @torch.inference_mode()
    def _propose(self, wanted) -> dict[str, list[int]]:
        kv = self.kv
        budget = self.max_pass_tokens
        chunks: list[SeqChunk] = []
        catch_up: list[tuple[str, int]] = []  # per chunk: seq_id, tokens it computes
        # (seq, k, index of its chunk) for full catch-ups; seq an engine Sequence (untyped here, as in
        # `wanted`: this package does not import the engine)
        ready: list[tuple[Any, int, int]] = []
        for group, seq, k in wanted:
            sid = seq.seq_id
            if not self._register(sid, seq, group.salt):
                continue
            c, n = kv.num_computed(sid), seq.num_tokens
            todo = n - c
            if todo > budget:  # a long catch-up: part of it now, proposals once it is done
                if budget > 0 and self._allocate(sid, budget):
                    chunks.append(SeqChunk(seq.token_ids[c:c + budget], c, kv.block_table(sid),
                                           group_tables=kv.group_tables(sid)))
                    catch_up.append((sid, budget))
                    budget = 0
                continue
            if not self._allocate(sid, todo + k - 1):
                continue
            budget -= todo
            ready.append((seq, k, len(chunks)))
            chunks.append(SeqChunk(seq.token_ids[c:n], c, kv.block_table(sid), group_tables=kv.group_tables(sid)))
            catch_up.append((sid, todo))
        if not chunks:
            return {}
        first = self.runner.execute(chunks).argmax(-1).tolist()
        for sid, todo in catch_up:
            kv.mark_computed(sid, todo)
        proposals = {seq.seq_id: [first[i]] for seq, _, i in ready}
        for j in range(1, max((k for _, k, _ in ready), default=0)):
            step = [(seq, proposals[seq.seq_id]) for seq, k, _ in ready if k > j]
            chunks = [SeqChunk([props[-1]], seq.num_tokens - 1 + j, kv.block_table(seq.seq_id),
                               group_tables=kv.group_tables(seq.seq_id)) for seq, props in step]
            for (_, props), token in zip(step, self.runner.execute(chunks).argmax(-1).tolist()):
                props.append(token)
        out = {}
        for seq, _, _ in ready:
            props = proposals[seq.seq_id]
            self.pending[seq.seq_id] = (seq.num_tokens, props)
            valid = next((i for i, t in enumerate(props) if t >= self.vocab), len(props))
            if valid:
                out[seq.seq_id] = props[:valid]
        return out

    def _register(self, sid: str, seq, salt: str | None) -> bool:
        """Hold ``seq`` in the draft's cache with the KV of its accepted proposals kept; False when
        the draft has no blocks for it."""
        kv = self.kv
        if sid in self.lists and self.lists[sid] is not seq.token_ids:
            self._drop(sid)  # a new sequence under a reused id
        if sid not in self.lists:
            try:
                kv.allocate_prompt(sid, seq.token_ids, 1, salt=salt)
            except OutOfBlocksError:
                return False
            self.lists[sid] = seq.token_ids
            return True
        base, props = self.pending.pop(sid, (-1, []))
        if base == kv.num_computed(sid):
            # proposal i's KV sits at position base + i (the last proposal's was never computed)
            m = 0
            last = seq.num_tokens - 1  # that token's logits give the next proposal: it is computed now
            while m < len(props) - 1 and base + m < last and seq.token_ids[base + m] == props[m]:
                m += 1
            if m:
                kv.mark_computed(sid, m)
        kv.rollback(sid)
        return True

    def _allocate(self, sid: str, num_tokens: int) -> bool:
        try:
            self.kv.allocate_slots(sid, num_tokens)
        except OutOfBlocksError:
            self._drop(sid)
            return False
        return True

    def _drop(self, sid: str) -> None:
        self.lists.pop(sid, None)
        self.pending.pop(sid, None)
        if sid in self.kv:
            self.kv.free(sid)

    def close(self) -> None:
        for sid in list(self.lists):
            self._drop(sid)
