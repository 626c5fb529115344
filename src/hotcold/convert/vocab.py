"""Write a Hugging Face checkpoint's tokenizer into GGUF `tokenizer.ggml.*` keys, as llama.cpp's converters do.

- `tokenizer.model` (SentencePiece) -> model "llama": tokens, scores, token types, space prefix, special ids.
- `tokenizer.json` with a byte-level BPE model (or GPT-2's `vocab.json` + `merges.txt`) -> model "gpt2":
  tokens, token types, merges, `pre`, special ids.

Special ids, add_bos/add_eos and the chat template come from `gguf.SpecialVocab` (tokenizer_config.json,
tokenizer.json, config.json), the same helper llama.cpp's scripts use; SentencePiece's own ids fill gaps.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import gguf

from hotcold.tokenizer.bpe import GPT4O_REGEX  # o200k (gpt-oss): upstream's converter names it "gpt-4o"
from hotcold.tokenizer.vocab import (
    CONTROL,
    GPT2_REGEX,
    LLAMA3_REGEX,
    NORMAL,
    QWEN2_REGEX,
    UNUSED,
    USER_DEFINED,
)

logger = logging.getLogger(__name__)

_PAD_SCORE = -1000.0


def write_vocab(writer: gguf.GGUFWriter, hf_dir: Path) -> str:
    """Write the tokenizer keys for the checkpoint in `hf_dir`; returns the kind written ("llama" or "gpt2")."""
    hf_dir = Path(hf_dir)
    if (hf_dir / "tokenizer.model").is_file():
        _write_sentencepiece(writer, hf_dir)
        return "llama"
    if (hf_dir / "tokenizer.json").is_file() or (hf_dir / "vocab.json").is_file():
        _write_byte_level_bpe(writer, hf_dir)
        return "gpt2"
    raise ValueError(
        f"{hf_dir}: no tokenizer found: expected tokenizer.model (SentencePiece), "
        "tokenizer.json or vocab.json + merges.txt (byte-level BPE)"
    )


# --------------------------------------------------------------------------- SentencePiece


def _load_sentencepiece_proto(path: Path):
    try:
        from sentencepiece import sentencepiece_model_pb2
    except ImportError as exc:  # sentencepiece is only needed to convert, never to run
        raise ImportError(
            f"{path}: reading a SentencePiece tokenizer.model needs the `sentencepiece` and `protobuf` packages "
            "(pip install sentencepiece protobuf)"
        ) from exc
    proto = sentencepiece_model_pb2.ModelProto()
    try:
        proto.ParseFromString(path.read_bytes())
    except Exception as exc:
        raise ValueError(f"{path}: not a SentencePiece model ({exc})") from exc
    if not proto.pieces:
        raise ValueError(f"{path}: SentencePiece model has no pieces")
    return proto


def _write_sentencepiece(writer: gguf.GGUFWriter, hf_dir: Path) -> None:
    path = hf_dir / "tokenizer.model"
    proto = _load_sentencepiece_proto(path)
    if proto.trainer_spec.model_type != proto.trainer_spec.BPE:
        logger.warning(
            "%s: SentencePiece model type %s is not BPE; llama-style GGUF tokenizers merge like BPE, "
            "so tokenization may differ from the original",
            path,
            proto.trainer_spec.ModelType.Name(proto.trainer_spec.model_type),
        )
    # SentencePiece's piece types use the GGUF numbers (normal 1 ... byte 6).
    tokens = [p.piece for p in proto.pieces]
    scores = [float(p.score) for p in proto.pieces]
    types = [int(p.type) or NORMAL for p in proto.pieces]

    # Tokens added on top of the SentencePiece model (added_tokens.json, tokenizer_config.json).
    added = _read_json(hf_dir / "added_tokens.json") or {}
    for text, token_id in sorted(added.items(), key=lambda kv: kv[1]):
        _place(tokens, scores, types, int(token_id), text, USER_DEFINED)
    config = _read_json(hf_dir / "tokenizer_config.json") or {}
    for key, entry in (config.get("added_tokens_decoder") or {}).items():
        token_id, text = int(key), entry.get("content")
        if not isinstance(text, str):
            continue
        kind = CONTROL if entry.get("special") else USER_DEFINED
        if token_id < len(tokens) and tokens[token_id] == text and types[token_id] not in (NORMAL, UNUSED):
            continue  # already a special piece of the model
        _place(tokens, scores, types, token_id, text, kind)
    _pad_to_config(tokens, types, hf_dir, scores)

    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    norm = proto.normalizer_spec
    writer.add_add_space_prefix(bool(norm.add_dummy_prefix))
    if norm.remove_extra_whitespaces:
        writer.add_remove_extra_whitespaces(True)

    special = gguf.SpecialVocab(hf_dir, load_merges=False, n_vocab=len(tokens))
    spec = proto.trainer_spec
    for typ, token_id in (
        ("unk", spec.unk_id),
        ("bos", spec.bos_id),
        ("eos", spec.eos_id),
        ("pad", spec.pad_id),
    ):
        if typ not in special.special_token_ids and 0 <= token_id < len(tokens):
            special.special_token_ids[typ] = token_id
    special.add_to_gguf(writer, quiet=True)


def _place(
    tokens: list[str], scores: list[float], types: list[int], token_id: int, text: str, kind: int
) -> None:
    if token_id < len(tokens):
        tokens[token_id] = text
        types[token_id] = kind
        return
    while len(tokens) < token_id:  # a hole before an added id: fill it like llama.cpp
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(UNUSED)
        if scores is not None:
            scores.append(_PAD_SCORE)
    tokens.append(text)
    types.append(kind)
    if scores is not None:
        scores.append(_PAD_SCORE)


def _pad_to_config(
    tokens: list[str], types: list[int], hf_dir: Path, scores: list[float] | None = None
) -> None:
    """Pad to config.json's vocab_size so token ids cover every embedding row (llama.cpp's [PADn] tokens)."""
    config = _read_json(hf_dir / "config.json") or {}
    size = config.get("vocab_size", config.get("text_config", {}).get("vocab_size"))
    if not isinstance(size, int):
        return
    if size < len(tokens):
        logger.warning(
            "%s: vocab_size %d is smaller than the tokenizer's %d tokens",
            hf_dir / "config.json",
            size,
            len(tokens),
        )
        return
    for i in range(len(tokens), size):
        tokens.append(f"[PAD{i}]")
        types.append(UNUSED)
        if scores is not None:
            scores.append(_PAD_SCORE)


# --------------------------------------------------------------------------- byte-level BPE


def _write_byte_level_bpe(writer: gguf.GGUFWriter, hf_dir: Path) -> None:
    path = hf_dir / "tokenizer.json"
    if path.is_file():
        data = _read_json(path)
        if not isinstance(data, dict):
            raise ValueError(f"{path}: not a tokenizers JSON file")
        model = data.get("model") or {}
        if model.get("type", "BPE") != "BPE" or not isinstance(model.get("vocab"), dict):
            raise ValueError(
                f"{path}: model type {model.get('type')!r} is not supported; hotcold converts BPE tokenizers"
            )
        if not _uses_byte_level(data):
            raise ValueError(
                f"{path}: BPE tokenizer without a ByteLevel pre-tokenizer/decoder (SentencePiece-style); "
                "put the model's tokenizer.model next to it"
            )
        vocab: dict[str, int] = model["vocab"]
        added = data.get("added_tokens") or []
        pre = _pre_name(data.get("pre_tokenizer"), path)
    else:  # GPT-2's original files (OPT checkpoints ship these): vocab.json + merges.txt
        path = hf_dir / "vocab.json"
        vocab = _read_json(path)
        if not isinstance(vocab, dict):
            raise ValueError(f"{path}: expected a JSON object token -> id")
        decoder = (_read_json(hf_dir / "tokenizer_config.json") or {}).get("added_tokens_decoder") or {}
        added = [{"id": int(k), **v} for k, v in decoder.items() if isinstance(v, dict)]
        pre = "gpt-2"

    added = [a for a in added if isinstance(a.get("content"), str) and isinstance(a.get("id"), int)]
    n = max([*vocab.values(), *(a["id"] for a in added)]) + 1
    tokens: list[str | None] = [None] * n
    types = [NORMAL] * n
    for text, token_id in vocab.items():
        tokens[token_id] = text
    for a in added:
        tokens[a["id"]] = a["content"]
        types[a["id"]] = CONTROL if a.get("special") or _looks_special(a["content"]) else USER_DEFINED
    for i, text in enumerate(tokens):
        if text is None:
            tokens[i] = f"[PAD{i}]"
            types[i] = UNUSED
    _pad_to_config(tokens, types, hf_dir)

    special = gguf.SpecialVocab(hf_dir, load_merges=True, n_vocab=len(tokens))
    if not special.merges:
        raise ValueError(f"{hf_dir}: no BPE merges found (tokenizer.json model.merges or merges.txt)")
    _fill_special_ids(special, tokens, hf_dir)

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special.add_to_gguf(writer, quiet=True)


def _fill_special_ids(special: gguf.SpecialVocab, tokens: list[str], hf_dir: Path) -> None:
    """Special ids SpecialVocab could not resolve, from the token strings in tokenizer_config.json."""
    config = _read_json(hf_dir / "tokenizer_config.json") or {}
    index = {text: i for i, text in reversed(list(enumerate(tokens)))}
    for typ in ("bos", "eos", "unk", "pad"):
        entry = config.get(f"{typ}_token")
        text = entry.get("content") if isinstance(entry, dict) else entry
        if typ not in special.special_token_ids and isinstance(text, str) and text in index:
            special.special_token_ids[typ] = index[text]


def _uses_byte_level(data: dict) -> bool:
    def has(node: Any) -> bool:
        if isinstance(node, dict):
            if node.get("type") == "ByteLevel":
                return True
            return any(has(v) for v in node.values())
        if isinstance(node, list):
            return any(has(v) for v in node)
        return False

    return has(data.get("pre_tokenizer")) or has(data.get("decoder"))


_SPECIAL_TEXTS = frozenset(["<s>", "</s>", "<pad>", "<unk>", "<mask>"])


def _looks_special(text: str) -> bool:
    return (text.startswith("<|") and text.endswith("|>")) or text in _SPECIAL_TEXTS


def _pre_name(pre: dict | None, path: Path) -> str:
    """The llama.cpp `tokenizer.ggml.pre` name for a tokenizers pre-tokenizer (llama.cpp hashes the
    tokenization of a probe text; the structure of the pre-tokenizer says the same for the ones we know)."""
    pre = pre or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre] if pre else []
    kinds = [s.get("type") for s in steps]

    def regex(step: dict) -> str | None:
        pattern = step.get("pattern") or {}
        return pattern.get("Regex") if isinstance(pattern, dict) else None

    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    if kinds[:3] == ["Punctuation", "ByteLevel", "Digits"] and any(
        regex(s) == "[0-9][0-9][0-9]" for s in steps
    ):
        return "falcon"
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        known = {LLAMA3_REGEX: "llama-bpe", QWEN2_REGEX: "qwen2", GPT2_REGEX: "gpt-2", GPT4O_REGEX: "gpt-4o"}
        if regex(steps[0]) in known:
            return known[regex(steps[0])]
    logger.warning(
        "%s: pre-tokenizer %s is not one hotcold knows; writing %s = 'default'",
        path,
        kinds,
        gguf.Keys.Tokenizer.PRE,
    )
    return "default"


def _read_json(path: Path) -> Any:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: invalid JSON ({exc})") from exc
