"""Moved to ``pagedkv/kv_events.py`` (the server imports the event types without the memory core).

Kept only while the memory core's restructuring lands; import from ``pagedkv.kv_events``.
"""

from pagedkv.kv_events import MEDIUMS, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventLog

__all__ = ["MEDIUMS", "AllBlocksCleared", "BlockRemoved", "BlockStored", "KVEvent", "KVEventLog"]
