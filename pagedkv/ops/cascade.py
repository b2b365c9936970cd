"""Shared-block (cascade) attention: find the runs of blocks several sequences of a step hold at
the same positions, and attend each run once for all the query rows that hold it.

Paging lets sequences point at the same physical blocks (a prefix-cache hit, the parent blocks of
``n > 1`` forks and beam candidates, forks of forks), but a per-sequence kernel streams a shared
prefix's K and V once per row. :func:`find_shared_runs` reads the step's block tables (once per
step and KV group; every layer of the group uses the result) as a tree: sequences that hold the
same block at logical position 0 form a branch, which continues while all of them hold the same
blocks, then splits by the next block; a branch of two or more sequences is a *node* (a token
range of one block run and the rows that hold it), a branch of one sequence is that sequence's
own tail. So a row's context is a path of nodes from position 0 (forks of forks: several) and then
its own blocks (``row_own_start`` on).

The rows of one sequence's extend chunk (a prompt's later chunks, a follower's own tokens after a
prefix hit) all see the blocks before the chunk whole: with enough rows and tokens (``CHUNK_MIN_ROWS``,
``CHUNK_MIN_TOKENS``) those blocks are a node of that one sequence too, after the nodes it shares
with others, so a long prompt's chunks attend their context as matrix products (case d's first
prompt: 1.5-3x faster per layer than the per-row kernel at 200 rows over 500-1,800 tokens).

:func:`cascade_attention` computes, in ``csrc/cascade_attention.cpp``, every node's partial
softmax state for all its rows (K and V read once, the queries batched), merges a row's partial
states by the log-sum-exp rule and continues the same online softmax over the row's own blocks.
Each row still sees exactly the slots it would see alone (its length and sliding window clip
every node), so the result is the per-row kernel's up to float32 rounding of a different sum
order; where the op is missing (an older build) the per-row kernel runs instead.

A shared block's *content* needs no check: the kernel reads, for each row, the same physical
slots the per-row kernel reads; sharing only decides which reads are done together. A sliding
group's released entries (-1) compare equal to one another: no row's window reaches them.
"""

from __future__ import annotations

import dataclasses
import os
from collections import defaultdict
from dataclasses import dataclass

import torch

from pagedkv.ops import native
from pagedkv.ops.paged_attention import NativeMetadata, QuantBlocks, native_paged_attention

MIN_SHARED_SEQS = 2  # sequences that must hold a run for it to be attended once
# A run is attended once when that saves at least this many token reads ((sequences - 1) x its
# tokens): below it the extra work item and the merge cost about what they save (measured on the
# native kernel: 2 rows x 96 shared tokens 0.94x, 2 x 256 1.03x, 1 x 1024 1.18x the per-row time).
MIN_SAVED_TOKENS = 512
PART_ROWS = 16  # rows of one node per work item of the Triton kernel (ops/triton/cascade.py)
# A node of one sequence's rows (an extend chunk) needs this many rows and whole blocks' tokens
# before its rows: below them the per-row kernel, which reads a key block once for a tile of 16 rows
# of a sequence, is as fast (measured, one thread, 9 heads / 3 KV heads / d 64: 16 rows x 200 tokens
# 1.01x, 64 x 64 0.98x, 16 x 1,000 1.34x, 200 x 1,800 1.73x, 400 x 1,600 2.97x the per-row time;
# 16 x 300, 64 x 512, 200 x 1,800: 1.2x, 2.3x, 1.9x with 8 heads of d 128 (MHA), 1.8-2.9x with 32
# heads / 8 KV heads, 1.1-2.2x with 8 heads / 1 KV head).
CHUNK_MIN_ROWS = 16
CHUNK_MIN_TOKENS = 256


@dataclass(slots=True)
class CascadePlan:
    """A step's shared runs for one KV group (see the module doc), as the kernels take them."""

    node_seq: torch.Tensor  # [N] int32: a sequence (row of the block tables) holding the node's blocks
    node_start: torch.Tensor  # [N] int32: first token position of the node
    node_end: torch.Tensor  # [N] int32: end token position (exclusive; a multiple of block_size)
    node_row_ptr: torch.Tensor  # [N + 1] int32: node n's rows are node_rows[ptr[n]:ptr[n + 1]]
    node_rows: torch.Tensor  # [E] int32: query rows
    row_own_start: torch.Tensor  # [rows] int32: where each row's own blocks start (0: shares nothing)
    # the same entries by row: row r's are row_entries[row_entry_ptr[r]:row_entry_ptr[r + 1]]
    row_entry_ptr: torch.Tensor  # [rows + 1] int32
    row_entries: torch.Tensor  # [E] int32: indices into node_rows
    # the nodes cut into parts of at most PART_ROWS rows (the Triton kernel's work items)
    part_node: torch.Tensor  # [P] int32
    part_first: torch.Tensor  # [P] int32: first entry (index into node_rows)
    part_count: torch.Tensor  # [P] int32
    shared_tokens: int  # sum over nodes of (rows - 1) * tokens: the key reads sharing saves, roughly

    @property
    def num_nodes(self) -> int:
        return int(self.node_seq.shape[0])

    def to(self, device: torch.device | str) -> CascadePlan:
        """The same plan with its tensors on ``device`` (the Triton kernels')."""
        return dataclasses.replace(self, **{f.name: getattr(self, f.name).to(device)
                                            for f in dataclasses.fields(self) if f.name != "shared_tokens"})


def find_shared_runs(tables: list[list[int]], row_seq: list[int], row_len: list[int], block_size: int,
                     min_seqs: int = MIN_SHARED_SEQS, min_saved_tokens: int | None = None,
                     chunk_min_rows: int | None = None, chunk_min_tokens: int | None = None,
                     ) -> CascadePlan | None:
    """The shared runs of one KV group's step, or None when nothing is shared (see below).

    ``tables[s]``: sequence s's block ids (covering its rows' lengths; -1 for a sliding group's
    released blocks); ``row_seq[r]``, ``row_len[r]``: each query row's sequence and visible length
    (0: the row is attended elsewhere). A branch that would save fewer than ``min_saved_tokens``
    token reads (default :data:`MIN_SAVED_TOKENS`) is not a node of its own: its blocks join each
    sub-branch's node (those sequences hold them too), or stay its rows' own. A sequence with at
    least ``chunk_min_rows`` rows (an extend chunk; default :data:`CHUNK_MIN_ROWS`) makes the
    blocks all its rows see whole, from where its shared nodes end, a node of its own when they
    hold ``chunk_min_tokens`` tokens (default :data:`CHUNK_MIN_TOKENS`) and save
    ``min_saved_tokens``. Cost: one
    lexicographic common-prefix per branch (C-level list comparisons) and one dict pass per split,
    so a step of 64 sequences costs well under a millisecond."""
    if min_seqs < 2:
        raise ValueError(f"min_seqs must be >= 2 (a run held by one sequence is its own), got {min_seqs}")
    least = MIN_SAVED_TOKENS if min_saved_tokens is None else min_saved_tokens
    chunk_rows = max(2, CHUNK_MIN_ROWS if chunk_min_rows is None else chunk_min_rows)
    chunk_tokens = CHUNK_MIN_TOKENS if chunk_min_tokens is None else chunk_min_tokens
    seq_rows: dict[int, list[int]] = defaultdict(list)
    for r, (s, n) in enumerate(zip(row_seq, row_len)):
        if n > 0:
            seq_rows[s].append(r)
    chunks = [s for s, rows in seq_rows.items() if len(rows) >= chunk_rows]
    if len(seq_rows) < min_seqs and not chunks:
        return None
    # Each sequence's blocks up to its longest row (the table may hold more, allocated ahead).
    blocks: dict[int, list[int]] = {}
    for s, rows in seq_rows.items():
        longest = max(row_len[r] for r in rows)
        blocks[s] = tables[s][: -(-longest // block_size)]
    nodes: list[tuple[int, int, int, list[int]]] = []  # (seq, start block, end block, seqs)
    own_start: dict[int, int] = {}

    def split(seqs: list[int], depth: int) -> list[list[int]]:
        by_block: dict[int, list[int]] = defaultdict(list)
        for s in seqs:
            if len(blocks[s]) > depth:
                by_block[blocks[s][depth]].append(s)
        return [g for g in by_block.values() if len(g) >= min_seqs]

    # (a branch's sequences, the first of their shared blocks not attended as shared above them)
    stack = [(g, 0) for g in split(list(seq_rows), 0)]
    while stack:
        seqs, start = stack.pop()
        end = len(os.path.commonprefix([blocks[s] for s in seqs]))  # lists compare as sequences do
        if end > start and (len(seqs) - 1) * (end - start) * block_size >= least:
            nodes.append((seqs[0], start, end, seqs))
            for s in seqs:
                own_start[s] = end
            start = end
        stack.extend((g, start) for g in split(seqs, end))
    for s in chunks:  # an extend chunk's rows share the blocks before it (after those shared with others)
        start, end = own_start.get(s, 0), min(row_len[r] for r in seq_rows[s]) // block_size
        while start < end and blocks[s][start] < 0:  # released: no row's window reaches them
            start += 1
        tokens = (end - start) * block_size
        if tokens > 0 and tokens >= chunk_tokens and (len(seq_rows[s]) - 1) * tokens >= least:
            nodes.append((s, start, end, [s]))
            own_start[s] = end
    if not nodes:
        return None
    nodes.sort(key=lambda n: n[1])  # parents before children (the kernel does not need it; tests read it)
    node_rows: list[int] = []
    ptr = [0]
    saved = 0
    for _, start, end, seqs in nodes:
        rows = [r for s in seqs for r in seq_rows[s] if row_len[r] > start * block_size]
        node_rows.extend(rows)
        ptr.append(len(node_rows))
        saved += max(0, len(rows) - 1) * (end - start) * block_size
    row_own = [own_start.get(s, 0) * block_size for s in row_seq]
    by_row: list[list[int]] = [[] for _ in row_seq]
    for e, r in enumerate(node_rows):
        by_row[r].append(e)
    row_ptr = [0]
    for entries in by_row:
        row_ptr.append(row_ptr[-1] + len(entries))
    parts = [(n, f, min(PART_ROWS, ptr[n + 1] - f)) for n in range(len(nodes))
             for f in range(ptr[n], ptr[n + 1], PART_ROWS)]

    def i32(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32)

    return CascadePlan(i32([n[0] for n in nodes]), i32([n[1] * block_size for n in nodes]),
                       i32([n[2] * block_size for n in nodes]), i32(ptr), i32(node_rows), i32(row_own),
                       i32(row_ptr), i32([e for entries in by_row for e in entries]),
                       i32([p[0] for p in parts]), i32([p[1] for p in parts]), i32([p[2] for p in parts]),
                       shared_tokens=saved)


_op: list[bool] = []  # whether the loaded build has the op, once known


def available() -> bool:
    """Whether the native cascade op is built (the native kernels and ``csrc/cascade_attention.cpp``)."""
    if not _op:
        if not native.available():
            return False
        _op.append(hasattr(torch.ops.pagedkv, "cascade_attention"))
    return _op[0]


def cascade_attention(
    out: torch.Tensor,  # [rows, heads, head_dim]: rows with row_len > 0 are written
    q: torch.Tensor,  # [rows, heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: NativeMetadata,
    plan: CascadePlan | None,
    scale: float | None = None,
    sliding_window: int | None = None,
    k_scales: torch.Tensor | None = None,  # [num_blocks, kv_heads] float32: 8-bit caches only
    v_scales: torch.Tensor | None = None,
    softcap: float | None = None,
    quant: QuantBlocks | None = None,
) -> torch.Tensor:
    """:func:`~pagedkv.ops.paged_attention.native_paged_attention` with the shared runs of
    ``plan`` attended once for all their rows (same arguments, a mixed pool's ``quant``
    included; same result up to float32 rounding); without a plan, or without the op, the
    per-row kernel. Returns ``out``."""
    if plan is None or not available():
        return native_paged_attention(out, q, k_cache, v_cache, meta, scale, sliding_window=sliding_window,
                                      k_scales=k_scales, v_scales=v_scales, softcap=softcap, quant=quant)
    if quant is not None:  # a mixed pool: the 8-bit blocks and their scales are quant's
        k_scales, v_scales = quant.k_scales, quant.v_scales
    d = q.shape[-1]
    qf = q.float().contiguous() if q.dtype != torch.float32 or not q.is_contiguous() else q
    target = out if out.dtype == torch.float32 else torch.empty(out.shape, dtype=torch.float32)
    torch.ops.pagedkv.cascade_attention(
        target, qf, k_cache, v_cache, meta.block_tables, meta.row_seq, meta.row_len,
        scale if scale is not None else d ** -0.5, sliding_window or 0, k_scales, v_scales, softcap or 0.0,
        plan.node_seq, plan.node_start, plan.node_end, plan.node_row_ptr, plan.node_rows, plan.row_own_start,
        quant.k_quant if quant is not None else None, quant.v_quant if quant is not None else None,
        quant.base if quant is not None else 0)
    if target is not out:
        rows = meta.row_len > 0
        out[rows] = target[rows].to(out.dtype)
    return out
