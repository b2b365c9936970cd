"""pagedkv's paged KV memory core: pure Python (no torch), shared by the engine, the simulator,
the sizing tool and the property tests."""

from pagedkv.memory.block import Block
from pagedkv.memory.block_pool import BlockPool
from pagedkv.memory.errors import IntegrityError, OutOfBlocksError
from pagedkv.memory.eviction import EVICTION_POLICIES, make_eviction_policy
from pagedkv.memory.free_queue import FreeBlockQueue
from pagedkv.memory.kv_cache_config import KVCacheConfig
from pagedkv.memory.kv_cache_manager import CopyPair, KVCacheManager
from pagedkv.memory.prefix_hash import chain_hashes, root_hash
from pagedkv.memory.prefix_index import PREFIX_INDEXES, HashChainIndex, PrefixIndex, RadixIndex
from pagedkv.memory.radix_index import RadixPrefixIndex
from pagedkv.memory.seq_state import FULL_PRECISION_SALT
from pagedkv.memory.stats import KVStats
from pagedkv.memory.tenant_ledger import DEFAULT_TENANT, TenantQuotaError

__all__ = [
    "DEFAULT_TENANT", "FULL_PRECISION_SALT",
    "TenantQuotaError",
    "Block", "BlockPool", "CopyPair", "EVICTION_POLICIES", "FreeBlockQueue", "HashChainIndex", "IntegrityError",
    "KVCacheConfig", "KVCacheManager", "KVStats", "OutOfBlocksError", "PREFIX_INDEXES", "PrefixIndex", "RadixIndex",
    "RadixPrefixIndex", "chain_hashes", "make_eviction_policy", "root_hash",
]
