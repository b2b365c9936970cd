"""The two prefix indexes (hash chain, radix tree) against each other, and the radix tree alone."""

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.memory import KVCacheManager, OutOfBlocksError, RadixPrefixIndex


def test_radix_splits_edges_and_forgets_blocks():
    idx = RadixPrefixIndex(block_size=2)
    idx.insert("t", [1, 2, 3, 4, 5, 6], [10, 11, 12])
    idx.insert("t", [1, 2, 3, 4, 9, 9], [10, 11, 13])
    idx.insert("u", [1, 2], [20])  # another tenant: its own tree
    assert idx.match("t", [1, 2, 3, 4, 5, 6, 7], 3) == [10, 11, 12]
    assert idx.match("t", [1, 2, 3, 4, 9, 9], 2) == [10, 11]
    assert idx.match("u", [1, 2, 3, 4], 2) == [20]
    assert idx.pretty_print().splitlines()[1:4] == [
        "  [10,11] tokens [1, 2, 3, 4]", "    [12] tokens [5, 6]", "    [13] tokens [9, 9]"]
    idx.remove(11)  # a middle block: longer prefixes become unreachable, the rest stays
    assert idx.match("t", [1, 2, 3, 4, 5, 6], 3) == [10]
    idx.insert("t", [1, 2, 3, 4], [10, 14])  # recomputed: the gap is filled again
    assert idx.match("t", [1, 2, 3, 4, 5, 6], 3) == [10, 14, 12]
    idx.remove(12)
    assert "[12]" not in idx.pretty_print()  # an empty leaf is pruned
    assert idx.check_integrity() == [] and len(idx) == 4


OPS = st.lists(st.tuples(st.sampled_from(["add", "free", "evict", "decode"]),
                         st.lists(st.integers(0, 2), min_size=1, max_size=14),
                         st.sampled_from([None, "x"]), st.integers(0, 50)),
               min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops=OPS, block_size=st.sampled_from([1, 2, 3, 4]), num_blocks=st.integers(4, 20),
       policy=st.sampled_from(["lru", "fifo", "lrc"]))
def test_hash_and_radix_indexes_agree(ops, block_size, num_blocks, policy):
    """Driven through the same operations, both managers find the same prefix hits and end in
    the same state at every step."""
    managers = [KVCacheManager(num_blocks, block_size, eviction_policy=policy, prefix_index=i)
                for i in ("hash", "radix")]
    live: list[int] = []
    seq_tokens: dict[int, list[int]] = {}  # each sequence's own token list, read by both managers
    for n, (op, tokens, salt, pick) in enumerate(ops):
        results = []
        if op == "add":
            seq_tokens[n] = list(tokens)
        elif op == "decode" and live:
            seq_tokens[live[pick % len(live)]].append(tokens[0])
        for kv in managers:
            try:
                if op == "add":
                    cached = kv.allocate_prompt(n, seq_tokens[n], salt=salt)
                    kv.mark_computed(n, len(tokens) - cached)
                    results.append(cached)
                elif op == "free" and live:
                    kv.free(live[pick % len(live)])
                elif op == "decode" and live:
                    seq = live[pick % len(live)]
                    results.append(kv.allocate_slots(seq, 1))
                    kv.mark_computed(seq, 1)
                elif op == "evict":
                    results.append(kv.evict_cached(pick % 3 or None))
            except OutOfBlocksError:
                results.append("oob")
            kv.check_integrity()
        assert results[:len(results) // 2] == results[len(results) // 2:], (op, results)
        if op == "add" and results[0] != "oob":
            live.append(n)
        elif op == "free" and live:
            live.pop(pick % len(live))
        h, r = managers
        assert h.stats() == r.stats()
        assert {s: h.block_table(s) for s in live} == {s: r.block_table(s) for s in live}
