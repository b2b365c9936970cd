"""Prompt lookup: propose the tokens that followed the last time the sequence's tail occurred.

The tail (the last n tokens, n from ``prompt_lookup_max`` down to ``prompt_lookup_min``) is
matched against the prompt and the output so far; the longest match wins, the most recent among
equals, and the k tokens after it are the proposal (a match close to the end continues the loop
it reveals). Copy-heavy work (repeat or edit a
passage, code, quotes, JSON echoing its input) continues a match for many tokens; on other text
nothing matches and nothing is proposed, which costs nothing.

Pure Python; the scan for the tail's last token runs in ``list.index`` (C), so a step over a
sequence of thousands of tokens costs microseconds.
"""

from __future__ import annotations


def propose_ngram(tokens: list[int], k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """Up to ``k`` proposed next tokens for ``tokens`` (empty when no n-gram of at least
    ``lookup_min`` tokens at the end occurred before)."""
    L = len(tokens)
    if k <= 0 or L < lookup_min + 1:
        return []
    last = tokens[-1]
    ends: list[int] = []  # earlier positions holding the tail's last token
    i = 0
    try:
        while True:
            i = tokens.index(last, i, L - 1)
            ends.append(i)
            i += 1
    except ValueError:
        pass
    best_len, best_end = 0, -1
    for j in reversed(ends):  # the most recent first: it wins ties
        m = 1
        limit = min(lookup_max, j + 1)
        while m < limit and tokens[j - m] == tokens[L - 1 - m]:
            m += 1
        if m > best_len:
            best_len, best_end = m, j
            if m >= lookup_max:
                break
    if best_len < lookup_min:
        return []
    # What followed the match; where that runs into the tail itself, the sequence is in a loop of
    # period ``L - 1 - best_end`` and the proposal continues it.
    period = L - 1 - best_end
    out = tokens[best_end + 1:best_end + 1 + k]
    while len(out) < k:
        out.append(out[len(out) - period])
    return out
