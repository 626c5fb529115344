"""SentencePiece-style BPE encoding (GGUF `tokenizer.ggml.model` "llama").

SentencePiece's (and llama.cpp's llm_tokenizer_spm) score-ordered bigram merge: characters are symbols,
the adjacent pair whose concatenation is the highest-scoring piece merges first (ties: leftmost),
characters outside the vocabulary fall back to `<0xXX>` byte tokens (else one <unk> per run).
Spaces are written as U+2581 and a space is prefixed when the caller says so.
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Sequence

from hotcold.tokenizer.types import BYTE, BYTE_PIECE, NORMAL, SPACE, UNUSED, USER_DEFINED


class SpmEncoder:
    """Encodes plain text (no special tokens) into ids of one SentencePiece-style vocabulary."""

    def __init__(
        self,
        tokens: Sequence[str],
        token_types: Sequence[int],
        scores: Sequence[float],
        *,
        unk_id: int | None = None,
        remove_extra_whitespaces: bool = False,
    ):
        self.unk_id = unk_id
        self.remove_extra_whitespaces = remove_extra_whitespaces
        # Pieces that can be produced by merging (SentencePiece's pieces_: normal, user-defined, unused),
        # with the negated score so the heap pops the best pair first.
        self._pieces: dict[str, tuple[int, float, bool]] = {}
        for i, (text, kind) in enumerate(zip(tokens, token_types)):
            if kind in (NORMAL, USER_DEFINED, UNUSED) and text not in self._pieces:
                self._pieces[text] = (i, -scores[i], kind == UNUSED)
        self._byte_ids: list[int | None] = [None] * 256
        for i, (text, kind) in enumerate(zip(tokens, token_types)):
            m = BYTE_PIECE.fullmatch(text)
            if kind == BYTE and m and self._byte_ids[int(m.group(1), 16)] is None:
                self._byte_ids[int(m.group(1), 16)] = i
        self._byte_fallback = all(b is not None for b in self._byte_ids)

    def encode(self, text: str, out: list[int], *, prefix: bool) -> None:
        """Append the ids for `text` to `out`; `prefix`: write a space before it first."""
        if self.remove_extra_whitespaces:
            text = re.sub(" +", " ", text.strip(" "))
            if not text:
                return
        if prefix:
            text = " " + text
        sym = list(text.replace(" ", SPACE))  # one symbol per character; "" once merged away
        n = len(sym)
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        get = self._pieces.get
        rev: dict[str, tuple[str, str]] = {}  # unused piece -> the pair it was made from

        heap = []
        for i in range(n - 1):
            pair = sym[i] + sym[i + 1]
            e = get(pair)
            if e is not None:
                heap.append((e[1], i, i + 1, len(pair)))
                if e[2]:
                    rev[pair] = (sym[i], sym[i + 1])
        heapq.heapify(heap)
        pop, push = heapq.heappop, heapq.heappush

        while heap:
            _, left, right, size = pop(heap)
            a, b = sym[left], sym[right]
            if not a or not b or len(a) + len(b) != size:
                continue  # stale: one side changed since this pair was queued
            merged = a + b
            sym[left] = merged
            sym[right] = ""
            nr = nxt[right]
            nxt[left] = nr
            if nr >= 0:
                prv[nr] = left
            p = prv[left]
            if p >= 0:
                pair = sym[p] + merged
                e = get(pair)
                if e is not None:
                    push(heap, (e[1], p, left, len(pair)))
                    if e[2]:
                        rev[pair] = (sym[p], merged)
            if nr >= 0:
                pair = merged + sym[nr]
                e = get(pair)
                if e is not None:
                    push(heap, (e[1], left, nr, len(pair)))
                    if e[2]:
                        rev[pair] = (merged, sym[nr])

        prev_unk = False
        i = 0
        while i >= 0:
            prev_unk = self._emit(sym[i], out, rev, prev_unk)
            i = nxt[i]

    def _emit(self, s: str, out: list[int], rev: dict[str, tuple[str, str]], prev_unk: bool) -> bool:
        e = self._pieces.get(s)
        if e is None:  # a character outside the vocabulary
            if self._byte_fallback:
                out.extend(self._byte_ids[b] for b in s.encode("utf-8"))
                return False
            if self.unk_id is None:
                raise ValueError(
                    f"cannot encode {s!r}: not in the vocabulary, no byte tokens and no unknown token"
                )
            if not prev_unk:  # SentencePiece folds a run of unknown characters into one <unk>
                out.append(self.unk_id)
            return True
        if e[2] and s in rev:  # unused pieces are split back into the pair that made them
            left, right = rev[s]
            prev_unk = self._emit(left, out, rev, prev_unk)
            return self._emit(right, out, rev, prev_unk)
        out.append(e[0])
        return False
