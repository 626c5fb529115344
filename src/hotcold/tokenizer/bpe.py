"""Byte-level BPE encoding (GGUF `tokenizer.ggml.model` "gpt2").

Encoded with a `tokenizers` BPE model built from the vocabulary and its merge list, behind a
pre-tokenizer chosen by `tokenizer.ggml.pre` (the splitting regexes llama.cpp uses for that name).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

logger = logging.getLogger(__name__)

# Byte-level BPE pre-tokenizers by `tokenizer.ggml.pre` name: a list of (kind, argument) steps.
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# OpenAI's o200k (gpt-oss, Llama 4): the tokenizer.json regex llama.cpp quotes for LLAMA_VOCAB_PRE_TYPE_GPT4O
GPT4O_REGEX = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS: dict[str, list[tuple[str, str]]] = {
    "gpt-4o": [("split", GPT4O_REGEX), ("bytelevel", "")],
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
    "llama4": "gpt-4o",  # llama.cpp reads these with GPT4O's split too
    "kanana2": "gpt-4o",
    "minimax-m2": "gpt-4o",
    "llama3": "llama-bpe",
    "smaug-bpe": "llama-bpe",
}

# `tokenizer.ggml.pre` names for which llama.cpp adds a BOS when the file has no add_bos_token
# (the Llama-3 family); other byte-level BPE vocabularies get none by default.
ADD_BOS_PRE = frozenset(
    ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"]
)


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


BYTE_DECODER = {c: b for b, c in bytes_to_unicode().items()}


def pre_tokenizer_name(pre: str | None) -> str:
    """The PRE_TOKENIZERS entry for a `tokenizer.ggml.pre` value (llama.cpp's default for unknown names)."""
    name = PRE_ALIASES.get(pre, pre) if pre is not None else "default"
    if name not in PRE_TOKENIZERS:
        logger.warning("unknown tokenizer.ggml.pre %r: splitting text with llama.cpp's default regexes", pre)
        name = "default"
    return name


class BpeEncoder:
    """Encodes plain text (no special tokens) into ids of one byte-level BPE vocabulary.

    `pre` is the PRE_TOKENIZERS name it splits text with (`tokenizer.ggml.pre` resolved)."""

    def __init__(self, tokens: Sequence[str], merges: Sequence[str], pre: str | None):
        from tokenizers import Regex, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers.models import BPE

        vocab: dict[str, int] = {}
        for i, text in enumerate(tokens):
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

        self.pre = name = pre_tokenizer_name(pre)
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

    def encode(self, text: str, out: list[int]) -> None:
        """Append the ids for `text` to `out`."""
        out.extend(self._hf.encode(text, add_special_tokens=False).ids)
