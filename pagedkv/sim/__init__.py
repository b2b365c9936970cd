"""Memory simulator and KV sizing tool: pure Python (no torch, no numpy).

``pagedkv simulate`` replays one request trace against several KV memory policies (contiguous
reservation, a buddy allocator and the real paged ``KVCacheManager``) and compares their waste,
fragmentation and concurrency; ``pagedkv size`` turns a model config and a device into KV block
figures. Entry points for the command line live in ``pagedkv.sim.cli``.
"""
