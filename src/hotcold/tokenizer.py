"""Tokenizer built from a GGUF file's vocabulary metadata alone (no sentencepiece, no transformers).

Two vocabulary kinds, named as `tokenizer.ggml.model` names them:
- "llama": SentencePiece-style BPE. Encoding is SentencePiece's (and llama.cpp's llm_tokenizer_spm)
  score-ordered bigram merge: characters are symbols, the adjacent pair whose concatenation is the
  highest-scoring piece merges first (ties: leftmost), characters outside the vocabulary fall back
  to `<0xXX>` byte tokens. Spaces are written as U+2581 and a space is prefixed when the model says so.
- "gpt2": byte-level BPE with merge ranks; encoded with a `tokenizers` BPE model and a pre-tokenizer
  chosen by `tokenizer.ggml.pre` (the splitting regexes llama.cpp uses for that name).

Special tokens (control and user-defined) are cut out of the text before either algorithm runs, as
llama.cpp does; control tokens only when `parse_special` is true (the default, as in llama.cpp's tools).
Decoding follows SentencePiece: control tokens are invisible, byte tokens are joined into UTF-8 with
U+FFFD for each byte that does not form a character, and the space the encoder prefixed is dropped.
"""

from __future__ import annotations

import codecs
import heapq
import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

logger = logging.getLogger(__name__)

# GGUF token types (llama.cpp's llama_token_type; the same numbers as SentencePiece's proto).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

KEY = "tokenizer.ggml."
SUPPORTED_MODELS = ("llama", "gpt2")
SPACE = "\u2581"  # SentencePiece's visible space
UNK_SURFACE = " \u2047 "  # what SentencePiece prints for <unk>
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")

# Control tokens that end a turn in common chat formats (llama.cpp treats these as end of generation).
_EOG_TEXTS = frozenset(
    [
        "<|eot_id|>",
        "<|eom_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<EOT>",
        "<|end_of_text|>",
    ]
)

# Byte-level BPE pre-tokenizers by `tokenizer.ggml.pre` name: a list of (kind, argument) steps.
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
PRE_TOKENIZERS: dict[str, list[tuple[str, str]]] = {
    "gpt-2": [("bytelevel_regex", "")],
    "falcon": [("punctuation", ""), ("bytelevel_regex", ""), ("digits", ""), ("split", "[0-9][0-9][0-9]")],
    "llama-bpe": [("split", LLAMA3_REGEX), ("bytelevel", "")],
    "qwen2": [("split", QWEN2_REGEX), ("bytelevel", "")],
    "default": [
        ("split", r"[\p{P}\$\+<=>\^~\|]+"),
        ("split", r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"),
        ("split", r"\p{N}+"),
        ("split", "[0-9][0-9][0-9]"),
        ("bytelevel", ""),
    ],
}
PRE_ALIASES = {
    "gpt2": "gpt-2",
    "phi-2": "gpt-2",
    "jina-es": "gpt-2",
    "jina-de": "gpt-2",
    "jina-v1-en": "gpt-2",
    "jina-v2-es": "gpt-2",
    "jina-v2-de": "gpt-2",
    "jina-v2-code": "gpt-2",
    "roberta-bpe": "gpt-2",
    "llama3": "llama-bpe",
    "smaug-bpe": "llama-bpe",
}


def _per_byte_replace(err: UnicodeDecodeError) -> tuple[str, int]:
    # SentencePiece maps every byte that does not start a valid character to its own U+FFFD
    # (Python's "replace" would merge a truncated sequence into one).
    if not isinstance(err, UnicodeDecodeError):
        raise err
    return "\ufffd" * (err.end - err.start), err.end


codecs.register_error("hotcold.per_byte", _per_byte_replace)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable characters."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


_BYTE_DECODER = {c: b for b, c in bytes_to_unicode().items()}


class Tokenizer:
    """Text <-> token ids for one GGUF vocabulary. Build it with `Tokenizer.from_metadata`."""

    def __init__(
        self,
        *,
        kind: str,
        tokens: list[str],
        token_types: list[int],
        scores: list[float] | None = None,
        merges: list[str] | None = None,
        bos_id: int | None = None,
        eos_id: int | None = None,
        unk_id: int | None = None,
        pad_id: int | None = None,
        add_bos: bool = True,
        add_eos: bool = False,
        add_space_prefix: bool = True,
        remove_extra_whitespaces: bool = False,
        pre: str | None = None,
        chat_template: str | None = None,
        eog_ids: Sequence[int] = (),
    ):
        self.kind = kind
        self.tokens = tokens
        self.token_types = token_types
        self.n_vocab = len(tokens)
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.unk_id = unk_id
        self.pad_id = pad_id
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.add_space_prefix = add_space_prefix if kind == "llama" else False
        self.remove_extra_whitespaces = remove_extra_whitespaces if kind == "llama" else False
        self.pre = pre
        self.chat_template = chat_template
        self.eog_ids = frozenset(i for i in eog_ids if i is not None)

        self._bytes: list[bytes | None] = [None] * self.n_vocab  # filled on first use
        self._special = self._special_matchers()
        if kind == "llama":
            self._init_spm(scores if scores is not None else [0.0] * self.n_vocab)
        else:
            self._init_bpe(merges or [], pre)

    # ----------------------------------------------------------------- construction from metadata

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any], *, source: str = "model") -> Tokenizer:
        """Build from GGUF metadata (key -> plain Python value); ValueError naming the key when it is unusable."""

        def get(name: str, default: Any = None) -> Any:
            return metadata.get(KEY + name, default)

        kind = get("model")
        if kind is None:
            raise ValueError(
                f"{source}: metadata has no {KEY}model (the vocabulary kind); supported: {', '.join(SUPPORTED_MODELS)}"
            )
        if kind not in SUPPORTED_MODELS:
            raise ValueError(
                f"{source}: {KEY}model is {kind!r}, which hotcold cannot tokenize; supported: {', '.join(SUPPORTED_MODELS)}"
            )
        tokens = get("tokens")
        if tokens is None:
            raise ValueError(f"{source}: metadata has no {KEY}tokens (the vocabulary)")
        if not isinstance(tokens, (list, tuple)) or not tokens:
            raise ValueError(f"{source}: {KEY}tokens must be a non-empty list of strings")
        tokens = [t.decode("utf-8", errors="replace") if isinstance(t, bytes) else str(t) for t in tokens]
        n = len(tokens)

        def int_list(name: str) -> list[int] | None:
            value = get(name)
            if value is None:
                return None
            if not isinstance(value, (list, tuple)) or len(value) != n:
                got = len(value) if isinstance(value, (list, tuple)) else type(value).__name__
                raise ValueError(
                    f"{source}: {KEY}{name} must be a list of {n} entries (one per token), got {got}"
                )
            return [int(v) for v in value]

        def special_id(name: str) -> int | None:
            value = get(name)
            if value is None:
                return None
            value = int(value)
            if value < 0 or value == 0xFFFFFFFF:  # some writers store -1 as uint32
                return None
            if value >= n:
                raise ValueError(f"{source}: {KEY}{name} is {value}, outside the vocabulary of {n} tokens")
            return value

        bos_id = special_id("bos_token_id")
        eos_id = special_id("eos_token_id")
        unk_id = special_id("unknown_token_id")
        pad_id = special_id("padding_token_id")
        eot_id = special_id("eot_token_id")
        eom_id = special_id("eom_token_id")

        scores = get("scores")
        if scores is not None:
            if not isinstance(scores, (list, tuple)) or len(scores) != n:
                got = len(scores) if isinstance(scores, (list, tuple)) else type(scores).__name__
                raise ValueError(
                    f"{source}: {KEY}scores must be a list of {n} floats (one per token), got {got}"
                )
            scores = [float(s) for s in scores]

        types = int_list("token_type")
        if types is None:
            types = _guess_types(tokens, kind, bos_id, eos_id, unk_id, pad_id)
        bad = next((t for t in types if t < 0 or t > BYTE), None)
        if bad is not None:
            raise ValueError(f"{source}: {KEY}token_type holds {bad}, not a token type (0-6)")

        merges = None
        pre = None
        if kind == "gpt2":
            merges = get("merges")
            if merges is None:
                raise ValueError(
                    f"{source}: metadata has no {KEY}merges, which a gpt2 (BPE) vocabulary needs"
                )
            if not isinstance(merges, (list, tuple)):
                raise ValueError(f"{source}: {KEY}merges must be a list of 'left right' strings")
            merges = [str(m) for m in merges]
            pre = get("pre")
            if pre is not None:
                pre = str(pre)

        chat_template = metadata.get("tokenizer.chat_template")
        if chat_template is not None and not isinstance(chat_template, str):
            raise ValueError(f"{source}: tokenizer.chat_template must be a string")

        eog = [eos_id, eot_id, eom_id]
        eog += [i for i, t in enumerate(tokens) if types[i] == CONTROL and t in _EOG_TEXTS]
        try:
            return cls(
                kind=kind,
                tokens=tokens,
                token_types=types,
                scores=scores,
                merges=merges,
                bos_id=bos_id,
                eos_id=eos_id,
                unk_id=unk_id,
                pad_id=pad_id,
                add_bos=bool(get("add_bos_token", kind == "llama")),
                add_eos=bool(get("add_eos_token", False)),
                add_space_prefix=bool(get("add_space_prefix", True)),
                remove_extra_whitespaces=bool(get("remove_extra_whitespaces", False)),
                pre=pre,
                chat_template=chat_template,
                eog_ids=eog,
            )
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from exc

    # ----------------------------------------------------------------- public interface

    def encode(self, text: str, *, add_bos: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids for `text`; BOS first when `add_bos` and the vocabulary has one.

        parse_special: text spelling a control token (e.g. "<|im_end|>") becomes that token, as llama.cpp's
        tools and Hugging Face tokenizers do. User-defined tokens are always matched."""
        out: list[int] = []
        if add_bos and self.bos_id is not None:
            out.append(self.bos_id)
        if not text:
            return out
        prev_special = True  # the space prefix goes before the first text and after each special token
        for piece, token in self._partition(text, parse_special):
            if token is not None:
                out.append(token)
                prev_special = True
            else:
                if self.kind == "llama":
                    self._spm_encode(piece, out, prefix=self.add_space_prefix and prev_special)
                else:
                    out.extend(self._hf.encode(piece, add_special_tokens=False).ids)
                prev_special = False
        return out

    def decode(self, ids: Sequence[int]) -> str:
        """Text for `ids` (SentencePiece semantics: control tokens invisible, the prefixed space dropped)."""
        state = _DecodeState(self)
        data = b"".join(state.next_bytes(int(i)) for i in ids)
        return data.decode("utf-8", errors="hotcold.per_byte")

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes one token contributes to the text (control and unused tokens: b"")."""
        self._check_id(token_id)
        data = self._bytes[token_id]
        if data is None:
            data = self._bytes[token_id] = self._compute_bytes(token_id)
        return data

    def piece(self, token_id: int) -> str:
        """The token's text as stored in the vocabulary (e.g. "<s>", "▁the", "Ġthe")."""
        self._check_id(token_id)
        return self.tokens[token_id]

    def is_eog(self, token_id: int) -> bool:
        """True for tokens that end generation: EOS, and end-of-turn / end-of-message tokens."""
        return token_id in self.eog_ids

    def __repr__(self) -> str:
        return f"Tokenizer(kind={self.kind!r}, n_vocab={self.n_vocab}, bos_id={self.bos_id}, eos_id={self.eos_id})"

    # ----------------------------------------------------------------- shared helpers

    def _check_id(self, token_id: int) -> None:
        if not 0 <= token_id < self.n_vocab:
            raise ValueError(f"token id {token_id} is outside the vocabulary (0..{self.n_vocab - 1})")

    def _compute_bytes(self, i: int) -> bytes:
        kind, text = self.token_types[i], self.tokens[i]
        if kind in (CONTROL, UNUSED):
            return b""
        if kind == UNKNOWN:
            return UNK_SURFACE.encode() if self.kind == "llama" else b""
        if kind == BYTE:
            m = _BYTE_PIECE.fullmatch(text)
            if m:
                return bytes([int(m.group(1), 16)])
            return text.encode("utf-8")
        if self.kind == "llama":
            return text.replace(SPACE, " ").encode("utf-8")
        if kind == USER_DEFINED:  # stored as plain text in byte-level vocabularies
            return text.encode("utf-8")
        dec = _BYTE_DECODER
        try:
            return bytes(dec[c] for c in text)
        except KeyError:  # not byte-level text: give it as it is
            return text.encode("utf-8")

    def _special_matchers(self) -> dict[bool, re.Pattern | None]:
        """Regexes that find special tokens in text: {parse_special: pattern}."""
        user = [i for i, t in enumerate(self.token_types) if t == USER_DEFINED and self.tokens[i]]
        control = [i for i, t in enumerate(self.token_types) if t in (CONTROL, UNKNOWN) and self.tokens[i]]
        self._special_ids: dict[str, int] = {}
        for i in user + control:
            self._special_ids.setdefault(self.tokens[i], i)

        def build(ids: list[int]) -> re.Pattern | None:
            texts = sorted({self.tokens[i] for i in ids}, key=len, reverse=True)
            return re.compile("|".join(map(re.escape, texts))) if texts else None

        return {False: build(user), True: build(user + control)}

    def _partition(self, text: str, parse_special: bool):
        """Yield (raw text, None) and ("", special token id) in order."""
        pattern = self._special[parse_special]
        if pattern is None:
            yield text, None
            return
        start = 0
        for m in pattern.finditer(text):
            if m.start() > start:
                yield text[start : m.start()], None
            yield "", self._special_ids[m.group()]
            start = m.end()
        if start < len(text):
            yield text[start:], None

    # ----------------------------------------------------------------- SentencePiece-style BPE

    def _init_spm(self, scores: list[float]) -> None:
        # Pieces that can be produced by merging (SentencePiece's pieces_: normal, user-defined, unused),
        # with the negated score so the heap pops the best pair first.
        self._pieces: dict[str, tuple[int, float, bool]] = {}
        for i, (text, kind) in enumerate(zip(self.tokens, self.token_types)):
            if kind in (NORMAL, USER_DEFINED, UNUSED) and text not in self._pieces:
                self._pieces[text] = (i, -scores[i], kind == UNUSED)
        self._byte_ids: list[int | None] = [None] * 256
        for i, (text, kind) in enumerate(zip(self.tokens, self.token_types)):
            m = _BYTE_PIECE.fullmatch(text)
            if kind == BYTE and m and self._byte_ids[int(m.group(1), 16)] is None:
                self._byte_ids[int(m.group(1), 16)] = i
        self._byte_fallback = all(b is not None for b in self._byte_ids)

    def _spm_encode(self, text: str, out: list[int], *, prefix: bool) -> None:
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
        pieces = self._pieces
        get = pieces.get
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
            prev_unk = self._spm_emit(sym[i], out, rev, prev_unk)
            i = nxt[i]

    def _spm_emit(self, s: str, out: list[int], rev: dict[str, tuple[str, str]], prev_unk: bool) -> bool:
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
            prev_unk = self._spm_emit(left, out, rev, prev_unk)
            return self._spm_emit(right, out, rev, prev_unk)
        out.append(e[0])
        return False

    # ----------------------------------------------------------------- byte-level BPE

    def _init_bpe(self, merges: list[str], pre: str | None) -> None:
        from tokenizers import Regex, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers.models import BPE

        vocab: dict[str, int] = {}
        for i, text in enumerate(self.tokens):
            vocab.setdefault(text, i)
        pairs = []
        dropped = 0
        for m in merges:
            cut = m.find(" ", 1)  # as llama.cpp: the first space after the first character
            left, right = (m[:cut], m[cut + 1 :]) if cut > 0 else (m, "")
            if left in vocab and right in vocab and left + right in vocab:
                pairs.append((left, right))
            else:
                dropped += 1
        if dropped:
            logger.warning(
                "%d of %d merges refer to tokens outside the vocabulary; ignored", dropped, len(merges)
            )

        name = PRE_ALIASES.get(pre, pre) if pre is not None else "default"
        if name not in PRE_TOKENIZERS:
            logger.warning(
                "unknown tokenizer.ggml.pre %r: splitting text with llama.cpp's default regexes", pre
            )
            name = "default"
        steps = []
        for step, arg in PRE_TOKENIZERS[name]:
            if step == "bytelevel_regex":
                steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
            elif step == "bytelevel":
                steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
            elif step == "punctuation":
                steps.append(pre_tokenizers.Punctuation(behavior="contiguous"))
            elif step == "digits":
                steps.append(pre_tokenizers.Digits(individual_digits=False))
            else:
                steps.append(pre_tokenizers.Split(Regex(arg), behavior="isolated", invert=False))
        hf = HFTokenizer(BPE(vocab=vocab, merges=pairs, ignore_merges=name == "llama-bpe"))
        hf.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
        self._hf = hf
        self.pre = name


class _DecodeState:
    """SentencePiece's decoding rules, one token at a time: which bytes each token adds."""

    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer
        self.strip_space = tokenizer.add_space_prefix or tokenizer.remove_extra_whitespaces

    def next_bytes(self, token_id: int) -> bytes:
        tok = self.tok
        data = tok.token_bytes(token_id)
        if not self.strip_space:
            return data
        kind = tok.token_types[token_id]
        if kind in (CONTROL, UNUSED):
            return data  # invisible; the next token is still the first
        if kind in (NORMAL, USER_DEFINED) and data.startswith(b" "):
            data = data[1:]
            # with remove_extra_whitespaces SentencePiece drops every leading space, else only the prefixed one
            self.strip_space = tok.remove_extra_whitespaces and not data
            return data
        self.strip_space = False
        return data


class StreamingDetokenizer:
    """Incremental detokenizer: `add(id)` returns the text that token completes, never half a UTF-8
    character. `"".join(add(i) for i in ids) + flush() == tokenizer.decode(ids)`.

    prompt_ids: tokens that come before the stream (a generation's prompt). They are read but not
    emitted, so the stream gives the text the new tokens add after them: a continuation keeps its
    leading space ("▁there" -> " there"), where a stream on its own drops the space SentencePiece prefixed."""

    def __init__(self, tokenizer: Tokenizer, *, prompt_ids: Sequence[int] = ()):
        self._state = _DecodeState(tokenizer)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="hotcold.per_byte")
        for token_id in prompt_ids:
            self.add(token_id)

    def add(self, token_id: int) -> str:
        return self._decoder.decode(self._state.next_bytes(int(token_id)))

    def flush(self) -> str:
        """Whatever is left (an unfinished character becomes U+FFFD per byte); the stream can go on after."""
        return self._decoder.decode(b"", final=True)


def _guess_types(tokens: list[str], kind: str, *special: int | None) -> list[int]:
    """Token types for vocabularies written without tokenizer.ggml.token_type."""
    types = [NORMAL] * len(tokens)
    if kind == "llama":
        for i, t in enumerate(tokens):
            if _BYTE_PIECE.fullmatch(t):
                types[i] = BYTE
    for i in special:
        if i is not None:
            types[i] = CONTROL
    unk = special[2]
    if unk is not None:
        types[unk] = UNKNOWN
    return types
