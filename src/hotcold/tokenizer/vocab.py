"""Tokenizer built from a GGUF file's vocabulary metadata alone (no sentencepiece, no transformers).

Two vocabulary kinds, named as `tokenizer.ggml.model` names them:
- "llama": SentencePiece-style BPE, encoded by `tokenizer.spm.SpmEncoder` (SentencePiece's and
  llama.cpp's score-ordered bigram merge with `<0xXX>` byte fallback).
- "gpt2": byte-level BPE with merge ranks, encoded by `tokenizer.bpe.BpeEncoder` (a `tokenizers` BPE
  model behind the pre-tokenizer llama.cpp uses for `tokenizer.ggml.pre`).

Special tokens (control and user-defined) are cut out of the text before either algorithm runs, as
llama.cpp does; control tokens only when `parse_special` is true (the default, as in llama.cpp's tools).
BOS and EOS are added as the file says (`add_bos_token`, `add_eos_token`; llama.cpp's defaults when
absent) unless the caller opts out.
Decoding follows SentencePiece: control tokens are invisible, byte tokens are joined into UTF-8 with
U+FFFD for each byte that does not form a character, and the space the encoder prefixed is dropped.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Mapping, Sequence
from typing import Any

from hotcold.tokenizer.bpe import (
    ADD_BOS_PRE,
    BYTE_DECODER,
    GPT2_REGEX,
    LLAMA3_REGEX,
    PRE_ALIASES,
    PRE_TOKENIZERS,
    QWEN2_REGEX,
    BpeEncoder,
    bytes_to_unicode,
)
from hotcold.tokenizer.eog import derive_eog_ids
from hotcold.tokenizer.spm import SpmEncoder
from hotcold.tokenizer.types import BYTE, BYTE_PIECE, CONTROL, NORMAL, SPACE, UNKNOWN, UNUSED, USER_DEFINED

__all__ = [
    "BYTE",
    "CONTROL",
    "GPT2_REGEX",
    "KEY",
    "LLAMA3_REGEX",
    "NORMAL",
    "PRE_ALIASES",
    "PRE_TOKENIZERS",
    "QWEN2_REGEX",
    "SPACE",
    "SUPPORTED_MODELS",
    "UNKNOWN",
    "UNUSED",
    "USER_DEFINED",
    "StreamingDetokenizer",
    "Tokenizer",
    "bytes_to_unicode",
]

KEY = "tokenizer.ggml."
SUPPORTED_MODELS = ("llama", "gpt2")
UNK_SURFACE = " \u2047 "  # what SentencePiece prints for <unk>


def _per_byte_replace(err: UnicodeDecodeError) -> tuple[str, int]:
    # SentencePiece maps every byte that does not start a valid character to its own U+FFFD
    # (Python's "replace" would merge a truncated sequence into one).
    if not isinstance(err, UnicodeDecodeError):
        raise err
    return "\ufffd" * (err.end - err.start), err.end


codecs.register_error("hotcold.per_byte", _per_byte_replace)
_SURROGATE = re.compile("[\ud800-\udfff]")  # not characters: no UTF-8 for them (e.g. a JSON "\ud800")


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
        self._spm: SpmEncoder | None = None
        self._bpe: BpeEncoder | None = None
        if kind == "llama":
            self._spm = SpmEncoder(
                tokens,
                token_types,
                scores if scores is not None else [0.0] * self.n_vocab,
                unk_id=unk_id,
                remove_extra_whitespaces=self.remove_extra_whitespaces,
            )
        else:
            self._bpe = BpeEncoder(tokens, merges or [], pre)
            self.pre = self._bpe.pre

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

        eog = derive_eog_ids(
            tokens,
            eos_id=eos_id,
            eot_id=eot_id,
            eom_id=eom_id,
            fim_pad_id=special_id("fim_pad_token_id"),
            fim_rep_id=special_id("fim_rep_token_id"),
            fim_sep_id=special_id("fim_sep_token_id"),
        )
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
                # defaults as llama.cpp: BOS for SentencePiece and Llama-3-style BPE vocabularies, never EOS
                add_bos=bool(get("add_bos_token", kind == "llama" or pre in ADD_BOS_PRE)),
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

    def encode(
        self, text: str, *, add_bos: bool = True, add_eos: bool | None = None, parse_special: bool = True
    ) -> list[int]:
        """Token ids for `text`, with the special tokens the vocabulary asks for (llama.cpp's add_special).

        add_bos: put BOS first if the file says so (`tokenizer.ggml.add_bos_token`, `self.add_bos`);
        False never adds it. add_eos: likewise EOS last (`add_eos_token`, `self.add_eos`); None follows
        add_bos, so `add_bos=False` asks for no special tokens at all.
        parse_special: text spelling a control token (e.g. "<|im_end|>") becomes that token, as llama.cpp's
        tools and Hugging Face tokenizers do. User-defined tokens are always matched.
        A lone surrogate code point (no character, no UTF-8) is encoded as U+FFFD."""
        if text and not text.isascii():
            text = _SURROGATE.sub("\ufffd", text)
        if add_eos is None:
            add_eos = add_bos
        out: list[int] = []
        if add_bos and self.add_bos and self.bos_id is not None:
            out.append(self.bos_id)
        if text:
            self._encode_text(text, out, parse_special)
        if add_eos and self.add_eos and self.eos_id is not None:
            out.append(self.eos_id)
        return out

    def _encode_text(self, text: str, out: list[int], parse_special: bool) -> None:
        prev_special = True  # the space prefix goes before the first text and after each special token
        for piece, token in self._partition(text, parse_special):
            if token is not None:
                out.append(token)
                prev_special = True
            else:
                if self._spm is not None:
                    self._spm.encode(piece, out, prefix=self.add_space_prefix and prev_special)
                else:
                    self._bpe.encode(piece, out)
                prev_special = False

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
        """True for tokens that end generation: EOS, end-of-turn / end-of-message tokens and the rest of
        llama.cpp's set (hotcold.tokenizer.eog)."""
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
            m = BYTE_PIECE.fullmatch(text)
            if m:
                return bytes([int(m.group(1), 16)])
            return text.encode("utf-8")
        if self.kind == "llama":
            return text.replace(SPACE, " ").encode("utf-8")
        if kind == USER_DEFINED:  # stored as plain text in byte-level vocabularies
            return text.encode("utf-8")
        dec = BYTE_DECODER
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
            if BYTE_PIECE.fullmatch(t):
                types[i] = BYTE
    for i in special:
        if i is not None:
            types[i] = CONTROL
    unk = special[2]
    if unk is not None:
        types[unk] = UNKNOWN
    return types
