"""Random allocate / grow / compute / fork / free / swap / evict sequences against a naive model.

The naive model keeps, for every sequence, its tokens and tenant; a simulated KV store keeps what
each physical slot holds. Writing a slot stores the token's whole prefix (what real KV depends
on), and block copies / swaps move stored contents exactly as the runner would. After every step:
``check_integrity()`` holds, and every computed position of every sequence, read through its block
table, holds that sequence's own prefix. A wrong prefix hit, a missed copy-on-write, a lost swap
copy or a write into a shared block all show up as a mismatch.

With per-tenant quotas (``quotas``) each salt is a tenant, and check_integrity() recounts the
tenant ledger from the blocks.

Hybrid models (``groups``: KV groups of full and sliding-window layers) keep one table per group;
the slots store the group too, and a released entry must be out of the window of the next query.

``PAGEDKV_STATEFUL_EXAMPLES`` sets how many random programs hypothesis runs (default 150, what CI
runs); a refactor of the memory core should pass it at 3000 once:

    PAGEDKV_STATEFUL_EXAMPLES=3000 .venv/bin/python -m pytest tests/memory/test_memory_stateful.py -q
"""

import os
from dataclasses import replace

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedkv.memory import KVCacheManager, OutOfBlocksError

TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=20)


class MemoryCoreMachine(RuleBasedStateMachine):
    @initialize(block_size=st.sampled_from([1, 2, 3, 4, 8]), num_blocks=st.integers(4, 24),
                num_host_blocks=st.integers(0, 16), policy=st.sampled_from(["lru", "fifo", "lrc"]),
                caching=st.booleans(), watermark=st.sampled_from([0.0, 0.1]),
                index=st.sampled_from(["hash", "radix"]),
                groups=st.sampled_from([(None,), (None,), (None, 2), (None, 3, 3), (None, None, 5), (None, 1)]),
                offload=st.booleans(),
                quotas=st.sampled_from([None, None, ({"t1": 0.3}, None), ({}, 0.4), ({"t1": 0.5}, 0.5)]))
    def setup(self, block_size, num_blocks, num_host_blocks, policy, caching, watermark, index, groups, offload,
              quotas):
        self.B = block_size
        self.windows = groups
        if len(groups) > 1:
            num_blocks *= len(groups)
        # With index="radix" the radix tree serves lookups and check_integrity() proves it
        # names exactly the blocks the hash chain does.
        self.kv = KVCacheManager(num_blocks, block_size, num_host_blocks=num_host_blocks,
                                 enable_prefix_caching=caching, eviction_policy=policy,
                                 watermark=watermark, prefix_index=index, kv_group_windows=groups,
                                 offload_to_host=offload, tenant_quotas=quotas and quotas[0],
                                 default_tenant_quota=quotas and quotas[1])
        self.device: dict[int, list] = {}  # block id -> slot contents
        self.host: dict[int, list] = {}
        self.ref: dict[int, tuple[list[int], str | None]] = {}  # seq -> (tokens, salt)
        self.next_id = 0

    # -- helpers -------------------------------------------------------------------------
    def _content(self, seq, pos, group=0):
        tokens, salt = self.ref[seq]
        return (group, salt, tuple(tokens[:pos + 1]))

    def _tables(self, seq):
        return [self.kv.block_table(seq), *self.kv.group_tables(seq)]

    def _check_reads(self, seq, store, upto):
        """Every position before ``upto`` that the next query may read holds this sequence's
        prefix, in every group; a released entry is out of that query's window."""
        for g, table in enumerate(self._tables(seq)):
            for pos in range(upto):
                block_id = table[pos // self.B]
                if block_id == -1:
                    assert g > 0 and pos <= self.kv.num_computed(seq) - self.windows[g], (seq, g, pos)
                    continue
                assert store[block_id][pos % self.B] == self._content(seq, pos, g), (seq, g, pos)

    def _write(self, seq, n):
        """Write KV for the next n tokens, as the runner would, then mark them computed."""
        start = self.kv.num_computed(seq)
        for g, table in enumerate(self._tables(seq)):
            for pos in range(start, start + n):
                block_id = table[pos // self.B]
                # Writing into a block another sequence still references would corrupt it.
                assert block_id >= 0 and self.kv.pool.blocks[block_id].ref_count == 1, (seq, pos, block_id)
                slots = self.device.setdefault(block_id, [None] * self.B)
                slots[pos % self.B] = self._content(seq, pos, g)
        self.kv.mark_computed(seq, n)

    def _copy(self, pairs, src, dst):
        for s, d in pairs:
            dst[d] = list(src.get(s, [None] * self.B))

    def _tier_copies(self):
        """The host tier's copies (evicted blocks down, a prompt's reloaded prefix up), made at
        once, as the runner makes them before anything else touches those blocks."""
        copies = self.kv.take_tier_copies()
        self._copy(copies.offloads, self.device, self.host)
        self._copy(copies.reloads, self.host, self.device)
        self.kv.finish_step()

    def _seqs(self, swapped):
        return sorted(s for s in self.ref if self.kv.is_swapped(s) == swapped)

    # -- rules ---------------------------------------------------------------------------
    @rule(tokens=TOKENS, salt=st.sampled_from([None, "t1"]), chunk=st.integers(1, 24))
    def add(self, tokens, salt, chunk):
        seq = self.next_id
        self.next_id += 1
        before = self.kv.stats()
        tokens = list(tokens)  # this sequence's own list: the manager reads it
        try:
            cached = self.kv.allocate_prompt(seq, tokens, chunk, salt=salt, tenant=salt)  # quotas: per salt
            self._tier_copies()
        except OutOfBlocksError as e:
            assert e.needed > e.available
            # nothing changed (but the count of allocations a tenant quota refused)
            assert replace(self.kv.stats(), tenant_quota_waits={}) == replace(before, tenant_quota_waits={})
            assert seq not in self.kv
            return
        assert cached % self.B == 0 and cached < len(tokens)
        self.ref[seq] = (tokens, salt)
        # Every hit position must already hold this very prefix (in every group, within the window).
        self._check_reads(seq, self.device, cached)
        self._write(seq, min(chunk, len(tokens) - cached))

    @precondition(lambda self: self._seqs(False))
    @rule(data=st.data(), k=st.integers(1, 8), new_token=st.integers(0, 2))
    def step(self, data, k, new_token):
        seq = data.draw(st.sampled_from(self._seqs(False)))
        tokens = self.ref[seq][0]
        if self.kv.num_computed(seq) == len(tokens):  # decode: a token was sampled
            tokens.append(new_token)
            k = 1
        k = min(k, len(tokens) - self.kv.num_computed(seq))
        tables_before = [list(t) for t in self._tables(seq)]
        try:
            copies = self.kv.allocate_slots(seq, k)
            self._tier_copies()
        except OutOfBlocksError:
            assert self._tables(seq) == tables_before
            return
        self._copy(copies, self.device, self.device)
        self._write(seq, k)

    @precondition(lambda self: self._seqs(False))
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self._seqs(False)))
        child = self.next_id
        self.next_id += 1
        tokens, salt = self.ref[parent]
        self.ref[child] = (list(tokens), salt)
        self.kv.fork(parent, child, self.ref[child][0])

    @precondition(lambda self: self.ref)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.ref)))
        self.kv.free(seq)
        del self.ref[seq]

    @precondition(lambda self: self._seqs(False))
    @rule(data=st.data())
    def swap_out(self, data):
        seqs = data.draw(st.lists(st.sampled_from(self._seqs(False)), min_size=1, max_size=3))
        try:
            pairs = self.kv.swap_out(seqs)
        except OutOfBlocksError:
            return
        self._copy(pairs, self.device, self.host)
        self._tier_copies()

    @precondition(lambda self: self._seqs(True))
    @rule(data=st.data())
    def swap_in(self, data):
        seqs = data.draw(st.lists(st.sampled_from(self._seqs(True)), min_size=1, max_size=3))
        try:
            pairs = self.kv.swap_in(seqs)
        except OutOfBlocksError:
            return
        self._tier_copies()  # offloads of blocks evicted to make room first, then the swap-in copies
        self._copy(pairs, self.host, self.device)

    @rule()
    def evict(self):
        self.kv.evict_cached()
        self._tier_copies()
        assert self.kv.stats().evictable_blocks == 0

    # -- invariants ----------------------------------------------------------------------
    @invariant()
    def consistent(self):
        if not hasattr(self, "kv"):
            return
        self.kv.check_integrity()
        for seq in self.ref:
            store = self.host if self.kv.is_swapped(seq) else self.device
            self._check_reads(seq, store, self.kv.num_computed(seq))

    def teardown(self):
        if not hasattr(self, "kv"):
            return
        for seq in list(self.ref):
            self.kv.free(seq)
        self.kv.check_integrity()
        s = self.kv.stats()
        assert s.used_blocks == 0 and s.host_used_blocks == 0


MemoryCoreMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("PAGEDKV_STATEFUL_EXAMPLES", "150")), stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestMemoryCore = MemoryCoreMachine.TestCase
