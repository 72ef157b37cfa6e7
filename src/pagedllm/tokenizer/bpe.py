"""Byte-pair encoding of one pre-token: merge ranks, the merge loop, a cache.

Owns: turning one pre-token (a piece of text that `pretokenize.py` cut out)
into vocabulary ids. Does not own: cutting the text, added/special tokens, or
decoding (`tokenizer.py`).

The rule, as GPT-2 and HF `tokenizers` apply it: write the pre-token as
byte-level symbols (one per UTF-8 byte), then repeatedly merge the adjacent
pair whose merge came earliest in training (lowest rank); on a tie, the
leftmost pair first. Stop when no adjacent pair has a rank. Each remaining
symbol is a vocabulary entry.

Invariant: `encode_piece(p)` depends only on `p`, which is what makes the
per-pre-token cache exact.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping

from pagedllm.tokenizer.bytelevel import bytes_to_symbols

# Distinct pre-tokens kept in the cache before it is emptied and refilled.
# Natural text has a Zipfian pre-token distribution, so a few hundred thousand
# entries hold nearly every repeat; clearing wholesale keeps this O(1) and simple.
CACHE_SIZE = 200_000


class BytePairEncoder:
    """A BPE model over a byte-level vocabulary.

    vocab: byte-level string -> id (e.g. "Ġworld" -> 1917)
    merges: pairs in training order; the index is the rank
    ignore_merges: Llama 3's shortcut: a pre-token that is itself a vocabulary
        entry becomes that one id without merging. (Merging could split it
        differently; Llama 3 was trained with the shortcut, so ids must follow.)
    """

    def __init__(
        self,
        vocab: Mapping[str, int],
        merges: Iterable[tuple[str, str]],
        *,
        ignore_merges: bool = False,
    ) -> None:
        self.vocab: dict[str, int] = dict(vocab)
        merges = list(merges)
        # Built from the end so that a duplicated merge keeps its first (lowest)
        # rank, as `tokenizers` does.
        self.ranks: dict[tuple[str, str], int] = dict(
            zip(reversed(merges), range(len(merges) - 1, -1, -1))
        )
        self.ignore_merges = ignore_merges
        self._cache: _PieceCache = _PieceCache(self._encode_uncached)

    def encode_piece(self, piece: str) -> tuple[int, ...]:
        """Ids of one pre-token (raw text, not yet byte-level)."""
        return self._cache[piece]

    def encode_pieces(self, pieces: list[str]) -> list[int]:
        """Ids of many pre-tokens, concatenated (the hot loop of `encode`)."""
        get = self._cache.__getitem__
        out: list[int] = []
        for ids in map(get, pieces):
            out += ids
        return out

    def _encode_uncached(self, piece: str) -> tuple[int, ...]:
        word = bytes_to_symbols(piece)
        vocab = self.vocab
        if self.ignore_merges and word in vocab:
            return (vocab[word],)
        # A byte with no vocabulary entry is dropped *before* merging, as
        # `tokenizers` does for a BPE model without an unknown token: its
        # neighbours then become adjacent and may merge ("{\x1d'" is one token
        # for SmolLM2, which has no entry for 0x1d). Most byte-level
        # vocabularies hold all 256 bytes; SmolLM2's lacks six control bytes,
        # so text holding them cannot round-trip through encode and decode.
        symbols = self.merge([s for s in word if s in vocab])
        return tuple(vocab[s] for s in symbols)

    def merge(self, symbols: list[str]) -> list[str]:
        """Apply merges to a list of symbols, lowest rank first, leftmost on ties.

        The symbols form a linked list (`nxt`/`prv`, by original position) and
        a heap holds candidate pairs as (rank, left position). A popped
        candidate is stale when either side has since been merged away; its
        rank then no longer names the current pair, and it is skipped. This is
        O(n log n), so a 10 000-byte run of CJK text (one pre-token for Llama 3)
        costs milliseconds, not the seconds of the textbook O(n^2) loop.
        """
        n = len(symbols)
        if n < 2:
            return symbols
        ranks = self.ranks
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        # (rank, left position, left symbol, right symbol): the pair's strings
        # ride along, so a stale entry is told by identity, with no lookup.
        heap = []
        for i in range(n - 1):
            left, right = symbols[i], symbols[i + 1]
            rank = ranks.get((left, right))
            if rank is not None:
                heap.append((rank, i, left, right))
        heapq.heapify(heap)
        pop, push = heapq.heappop, heapq.heappush
        while heap:
            rank, i, left, right = pop(heap)
            j = nxt[i]
            # Stale: the left symbol was absorbed or grew, or the right one changed
            # since the push (a merged symbol is a new string object).
            if j == -1 or symbols[i] is not left or symbols[j] is not right:
                continue
            # Merge j into i and unlink j.
            merged = symbols[i] = left + right
            symbols[j] = None
            k = nxt[j]
            nxt[i] = k
            if k != -1:
                prv[k] = i
            # The merged symbol forms new pairs with both neighbours.
            p = prv[i]
            if p != -1:
                before = symbols[p]
                r = ranks.get((before, merged))
                if r is not None:
                    push(heap, (r, p, before, merged))
            if k != -1:
                after = symbols[k]
                r = ranks.get((merged, after))
                if r is not None:
                    push(heap, (r, i, merged, after))
        return [s for s in symbols if s is not None]


class _PieceCache(dict):
    """pre-token -> ids; a miss computes, stores and returns (dict.__missing__)."""

    def __init__(self, compute) -> None:
        super().__init__()
        self._compute = compute

    def __missing__(self, piece: str) -> tuple[int, ...]:
        ids = self._compute(piece)
        if len(self) >= CACHE_SIZE:
            self.clear()
        self[piece] = ids
        return ids
