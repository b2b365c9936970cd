"""The prefix cache: which computed blocks other prompts may reuse, and how a prompt finds them.

Owns the block hashing of sequences (``SeqState.block_hashes``), caching full computed blocks in
the device pool (every KV group's, under the group's key), the prefix index (hash chain or radix
tree), the one walk along a prompt's hash chain (admission's hits, prefixes in flight, the
read-ahead of the disk tier all use ``walk``), the KV events of blocks stored, the miss history
(``memory/miss_reasons.py``) and the hit counters.

A prompt's chain, as admission sees it (group 0; a sliding group needs only its window's blocks
before the first uncached token, ``KVGroup.hit_start``)::

    block:     0    1    2    3    4    5        (the block holding the last prompt token is
    where:   [ dev  dev  dev  host host | miss ]  never a hit: its logits must be computed)
               index.match      host run

Only blocks whose tokens are settled are hashed and only computed ones are cached, so a block is
never served to another request before its KV exists. Pure Python.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from pagedkv.kv_events import MEDIUMS, KVEventLog
from pagedkv.memory.block import Block
from pagedkv.memory.block_pool import BlockPool
from pagedkv.memory.errors import IntegrityError
from pagedkv.memory.kv_groups import KVGroup
from pagedkv.memory.miss_reasons import UNSALTED_ROOT, CacheDetails, CacheHistory
from pagedkv.memory.prefix_hash import chain_hashes, group_hash
from pagedkv.memory.prefix_index import PrefixIndex
from pagedkv.memory.seq_state import RELEASED, SeqState
from pagedkv.memory.tenant_ledger import DEFAULT_TENANT
from pagedkv.memory.tiers.base import DEVICE

FULL_PRECISION_EVENT_KEY = "kv:full-precision"  # extra_keys entry of blocks kept at full precision

DEVICE_MEDIUM = MEDIUMS[DEVICE]


@dataclass(slots=True)
class PrefixHit:
    """A prefix hit of ``k`` blocks for every KV group: ``blocks[g]`` are group g's blocks for
    positions ``k - len(blocks[g]) .. k - 1`` (group 0: all k), ``on_host[g]`` says which of them
    are host-tier blocks to reload."""

    k: int
    blocks: list[list[Block]]
    on_host: list[list[bool]]
    num_host: int = 0  # host-tier blocks among them, every group's

    def first_reload(self) -> int:
        """The first block position any group reloads from the host tier (``k``: none)."""
        first = self.k
        for blocks, flags in zip(self.blocks, self.on_host):
            if True in flags:
                first = min(first, self.k - len(blocks) + flags.index(True))
        return first


class PrefixCache:
    """Args:
        pool: the device pool whose hash map holds the cached blocks.
        groups: the KV groups (``memory/kv_groups.py``); group 0 is the chain's anchor.
        block_size: token slots per block.
        index: finds a prompt's device hits (``memory/prefix_index.py``).
        history: why prompts miss (``memory/miss_reasons.py``); it hears of evictions itself.
        events: the KV event log for blocks stored on the device, or None.
    """

    def __init__(self, pool: BlockPool, groups: Sequence[KVGroup], block_size: int, index: PrefixIndex,
                 history: CacheHistory, events: KVEventLog | None = None) -> None:
        self.pool = pool
        self.groups = tuple(groups)
        self.block_size = block_size
        self.index = index
        self.history = history
        self.events = events
        self.query_tokens = 0  # prompt tokens looked up at admission
        self.hit_tokens = 0  # of them, found cached (device or host tier)
        self.first_misses: dict[tuple[str, str | None], int] = {}  # (reason, tenant) -> requests
        self.no_hit = PrefixHit(0, [[] for _ in self.groups], [[] for _ in self.groups])  # (read only)

    # ------------------------------------------------------------------ the chain
    def hash_full_blocks(self, seq: SeqState, full: int) -> None:
        """Extend the sequence's hash chain to its first ``full`` blocks (all full of tokens).

        Only blocks whose tokens are settled are hashed: the prompt's, or computed ones. A block
        the caller is still filling with sampled tokens is not, so a fork taken later carries
        only hashes of the tokens it shares with its parent."""
        done = len(seq.block_hashes)
        if full > done:
            parent = seq.block_hashes[-1] if done else seq.root
            seq.block_hashes.extend(chain_hashes(parent, seq.token_ids, self.block_size, done, full))

    def walk(self, root: bytes, token_ids: list[int], num_blocks: int) -> Iterator[bytes]:
        """The chain hashes of the prompt's first ``num_blocks`` blocks, each computed only when
        the walk gets there (a walk that stops at its first miss hashes no further)."""
        B = self.block_size
        parent = root
        for i in range(num_blocks):
            parent = chain_hashes(parent, token_ids, B, i, i + 1)[0]
            yield parent

    def hashes(self, root: bytes, token_ids: list[int], num_blocks: int) -> list[bytes]:
        """The chain hashes of the prompt's first ``num_blocks`` blocks, all at once."""
        return chain_hashes(root, token_ids, self.block_size, 0, max(num_blocks, 0))

    @staticmethod
    def max_hits(num_tokens: int, block_size: int) -> int:
        """The most blocks of a prompt that can hit: never the one holding its last token."""
        return (num_tokens - 1) // block_size

    # ------------------------------------------------------------------ finding hits
    def longest_hit(self, root: bytes, token_ids: list[int], hashes: list[bytes], max_hits: int,
                    host: BlockPool | None) -> PrefixHit:
        """The longest prefix of at most ``max_hits`` blocks (``hashes``: the prompt's chain, at
        least that long) that every group can serve: group 0 its device run (``index.match``)
        continued by the host tier's run (given ``host``), each other group the blocks of its
        ``hit_start`` span, from the device or the host tier."""
        device = self.index.match(self.pool, root, token_ids, hashes, max_hits)
        chain = device
        flags = [False] * len(device)
        if host is not None:
            cached = host.cached
            for h in hashes[len(device):max_hits]:
                block = cached.get(h)
                if block is None:
                    break
                if chain is device:
                    chain = list(device)
                chain.append(block)
                flags.append(True)
        k = len(chain)
        if len(self.groups) == 1:
            return PrefixHit(k, [chain], [flags], k - len(device))
        found: dict[tuple[int, int], tuple[Block, bool] | None] = {}

        def find(g: int, i: int) -> tuple[Block, bool] | None:
            if (g, i) not in found:
                key = group_hash(hashes[i], g)
                block = self.pool.cached.get(key)
                entry = (block, False) if block is not None else None
                if entry is None and host is not None:
                    block = host.cached.get(key)
                    entry = (block, True) if block is not None else None
                found[g, i] = entry
            return found[g, i]

        B = self.block_size
        while k > 0:
            spans = [range(group.hit_start(k, B), k) for group in self.groups[1:]]
            if all(find(g, i) is not None for g, span in enumerate(spans, start=1) for i in span):
                parts = [[find(g, i) for i in span] for g, span in enumerate(spans, start=1)]
                blocks = [chain[:k]] + [[e[0] for e in part] for part in parts]  # type: ignore[index]  # all found
                on_host = [flags[:k]] + [[e[1] for e in part] for part in parts]  # type: ignore[index]  # all found
                return PrefixHit(k, blocks, on_host, sum(sum(f) for f in on_host))
            k -= 1
        return self.no_hit

    def reads_below(self, root: bytes, token_ids: list[int], hashes: list[bytes], max_hits: int,
                    host: BlockPool, on_disk: Callable[[bytes], bool]) -> tuple[int, list[bytes], dict[bytes, int]]:
        """What a waiting prompt should read from a tier below the host (``on_disk`` says what it
        holds): ``(query tokens, keys, tokens of each key)`` for the longest prefix every group
        can serve from the device, the host tier or below, the keys of it only that tier holds
        (group 0's stand for a block of prompt tokens, the others' for none), and the prompt
        tokens past what the device and host serve."""
        B = self.block_size
        near = self.longest_hit(root, token_ids, hashes, max_hits, host).k
        device, above = self.pool.cached, host.cached
        where: dict[tuple[int, int], str | None] = {}

        def find(g: int, i: int) -> str | None:
            if (g, i) not in where:
                key = group_hash(hashes[i], g)
                where[g, i] = "mem" if key in device or key in above else ("below" if on_disk(key) else None)
            return where[g, i]

        chain = 0
        while chain < max_hits and find(0, chain) is not None:
            chain += 1
        for k in range(chain, near, -1):
            spans = [range(group.hit_start(k, B), k) for group in self.groups]
            if all(find(g, i) is not None for g, span in enumerate(spans) for i in span):
                keys = {group_hash(hashes[i], g): B if g == 0 else 0
                        for g, span in enumerate(spans) for i in span if find(g, i) == "below"}
                return (max_hits - near) * B, list(keys), keys
        return (max_hits - near) * B, [], {}

    def device_hits(self, root: bytes, token_ids: list[int]) -> tuple[int, int]:
        """``(hits, revived)``: the prompt's leading blocks cached on the device (group 0), and
        how many of them are cached-free (an admission takes them off the free queue)."""
        hits = revived = 0
        cached = self.pool.cached
        for h in self.walk(root, token_ids, self.max_hits(len(token_ids), self.block_size)):
            block = cached.get(h)
            if block is None:
                break
            hits += 1
            revived += block.ref_count == 0
        return hits, revived

    def first_uncached(self, root: bytes, token_ids: list[int], holds: Callable[[bytes], bool]) -> bytes | None:
        """The hash of the prompt's first block (of those that can hit) that ``holds`` says no
        tier has, or None when every one is held."""
        for h in self.walk(root, token_ids, self.max_hits(len(token_ids), self.block_size)):
            if not holds(h):
                return h
        return None

    # ------------------------------------------------------------------ caching
    def cache_full_blocks(self, seq: SeqState) -> None:
        """Offer the sequence's full computed blocks past ``num_cached_blocks`` to the cache:
        every group's under its own key, group 0's also to the index, the history and the
        KV events."""
        B = self.block_size
        full = seq.num_computed // B
        self.hash_full_blocks(seq, full)
        blocks = self.pool.blocks
        start = seq.num_cached_blocks
        content = None
        if seq.root != UNSALTED_ROOT:  # the same tokens' unsalted chain (another tenant's view)
            done = len(seq.content_hashes)
            if full > done:
                seq.content_hashes += chain_hashes(seq.content_hashes[-1] if done else UNSALTED_ROOT,
                                                   seq.token_ids, B, done, full)
            content = seq.content_hashes
        self.history.on_cached(seq.root, seq.block_hashes, seq.token_ids, start, full, content)
        table = seq.tables[0]
        new = self.pool.cache([blocks[i] for i in table[start:full]], seq.block_hashes[start:full])
        if new and self.events is not None:
            self._stored_events(seq, [start + i for i in new])
        self.index.on_cached(self.pool, seq.root, seq.token_ids, table, seq.block_hashes, full)
        for g in range(1, len(seq.tables)):  # the other groups' blocks, under their own keys
            other = seq.tables[g]
            pairs = [(blocks[other[i]], group_hash(seq.block_hashes[i], g))
                     for i in range(start, full) if other[i] != RELEASED]
            self.pool.cache((b for b, _ in pairs), (h for _, h in pairs), kv_group=g)
        seq.num_cached_blocks = full

    def _stored_events(self, seq: SeqState, new: list[int]) -> None:
        """BlockStored events for the sequence's blocks ``new`` (indices, ascending), one per run
        of consecutive blocks; the salt travels only as the root hash it made, and a full-precision
        request's blocks (a mixed pool) carry ``FULL_PRECISION_EVENT_KEY`` in ``extra_keys``."""
        B, hashes, events = self.block_size, seq.block_hashes, self.events
        assert events is not None
        extra = None if seq.root == UNSALTED_ROOT else [seq.root.hex()]
        if seq.full_precision:  # a mixed pool's full-precision request: its blocks' format, said (its root differs too)
            extra = [*(extra or []), FULL_PRECISION_EVENT_KEY]
        run = [new[0]]
        for i in new[1:] + [-1]:
            if i == run[-1] + 1:
                run.append(i)
                continue
            first, last = run[0], run[-1] + 1
            events.stored(hashes[first:last], hashes[first - 1] if first else None,
                          seq.token_ids[first * B:last * B], DEVICE_MEDIUM, extra, seq.adapter)
            run = [i]

    # ------------------------------------------------------------------ misses
    def admitted(self, seq: SeqState, salt: str | None, adapter_id: str | None) -> None:
        """A prompt is being admitted under ``seq.root`` (the miss history keeps what the root
        was made of: ``different_adapter``)."""
        self.history.on_root(seq.root, salt, adapter_id)

    def count(self, num_tokens: int, hit_tokens: int) -> None:
        self.query_tokens += num_tokens
        self.hit_tokens += hit_tokens

    def details(self, seq: SeqState, tenant: str | None) -> CacheDetails:
        """The prefix-cache outcome of the sequence's admission: hit tokens per tier and why its
        first missed block missed, counted per reason and ``tenant`` in ``first_misses``."""
        B = self.block_size
        device, host, disk, max_hits, skipped, remote = seq.hits
        hits = device + host
        reason, caller_reason, extra = self.history.explain(seq.root, seq.token_ids, seq.block_hashes, hits,
                                                            max_hits, in_host=skipped)
        tiers = {"device": device * B, "host": (host - disk - remote) * B, "disk": disk * B}
        if remote:  # (read from the server shared by replicas: reloaded through the host tier)
            tiers["remote"] = remote * B
        details = CacheDetails(len(seq.token_ids), hits * B, tiers,
                               reason, caller_reason, None if reason == "none" else hits, **extra)
        key = (reason, tenant)
        self.first_misses[key] = self.first_misses.get(key, 0) + 1
        return details

    def first_misses_by_reason(self) -> dict[str, dict[str, int]]:
        """``first_misses`` as ``{reason: {tenant: requests}}`` (``KVStats.first_misses``)."""
        out: dict[str, dict[str, int]] = {}
        for (reason, tenant), n in self.first_misses.items():
            per = out.setdefault(reason, {})
            per[tenant or DEFAULT_TENANT] = per.get(tenant or DEFAULT_TENANT, 0) + n
        return out

    # ------------------------------------------------------------------ checks
    def check(self, seqs: Iterable[SeqState]) -> None:
        """Every cached block a device sequence holds carries the hash of that sequence's prefix
        (its group's key), and the index agrees with the pool's hash map."""
        blocks = self.pool.blocks
        for seq in seqs:
            if not seq.on_device:
                continue
            for g, table in enumerate(seq.tables):
                for i in range(seq.num_cached_blocks):
                    if table[i] == RELEASED:
                        continue
                    h = blocks[table[i]].block_hash
                    if h is not None and h != group_hash(seq.block_hashes[i], g):
                        raise IntegrityError(f"sequence {seq.seq_id!r} block {i} of group {g} holds "
                                             f"another prefix's hash")
        self.index.check(self.pool)
