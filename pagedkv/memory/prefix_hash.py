"""Block hashes for automatic prefix caching: a hash chain over full blocks.

    hash(block i) = SHA-256( hash(block i-1) | token ids of block i )
    hash(block -1) = SHA-256( "pagedkv" | salt | adapter id )      (the chain's root)

Chaining makes a hash name the whole prefix up to and including the block, so two blocks with
the same tokens after different prefixes never match. The per-tenant salt and the adapter id
enter at the root, so they isolate every block of the chain. SHA-256 is collision resistant: a
collision would silently serve another prompt's KV, which a fast non-cryptographic hash cannot
rule out.
"""

from __future__ import annotations

import hashlib
from array import array


def root_hash(salt: str | None = None, adapter_id: str | None = None) -> bytes:
    """The parent hash of a sequence's first block."""
    h = hashlib.sha256(b"pagedkv-prefix-v1")
    if salt is not None:
        h.update(b"\x00salt\x00" + salt.encode())
    if adapter_id is not None:
        h.update(b"\x00adapter\x00" + adapter_id.encode())
    return h.digest()


def chain_hashes(parent: bytes, token_ids: list[int], block_size: int, start_block: int,
                 end_block: int) -> list[bytes]:
    """Hashes of full blocks ``start_block .. end_block-1``; ``parent`` is block start_block-1's."""
    if end_block <= start_block:
        return []
    data = array("q", token_ids[start_block * block_size:end_block * block_size]).tobytes()
    step = 8 * block_size
    sha256 = hashlib.sha256
    out: list[bytes] = []
    for off in range(0, len(data), step):
        parent = sha256(parent + data[off:off + step]).digest()
        out.append(parent)
    return out


def group_hash(block_hash: bytes, group: int) -> bytes:
    """The cache key of KV group ``group``'s block of the prefix ``block_hash`` names (a hybrid
    model keeps a block per group for each block of tokens, ``memory/kv_groups.py``); group 0's is
    the chain hash itself."""
    if group == 0:
        return block_hash
    return hashlib.sha256(block_hash + b"\x00group\x00" + group.to_bytes(4, "little")).digest()
