"""Train the demo model's SentencePiece tokenizer on the training split of the corpus.

BPE, vocabulary 8192, set up like LLaMA's tokenizer: identity normalisation, no whitespace
collapsing, a dummy prefix space, digits split, byte fallback (any text encodes, nothing maps to
<unk>), ids unk 0 / bos 1 / eos 2, no pad. Writes into ``--out``:

- ``tokenizer.model`` (the SentencePiece model; reading it back needs ``protobuf`` for transformers),
- ``tokenizer_config.json`` (Hugging Face: add BOS, special tokens, a plain chat template),
- ``special_tokens_map.json``.

No ``tokenizer.json``: transformers 5.x's conversion of a ``.model`` file disagrees with
SentencePiece on leading spaces and whitespace runs, so consumers should read ``tokenizer.model``.
``train_model.py`` copies these files into the checkpoint folder.

Usage::

    python scripts/demo_model/train_tokenizer.py --corpus /work/demo_build/corpus/train.txt \\
        --out /work/demo_build/tokenizer
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import sentencepiece as spm

VOCAB_SIZE = 8192

# "User: ...\nAssistant: ..." turns; a system message is a plain first paragraph. The template
# emits BOS itself, as Hugging Face templates do (apply_chat_template tokenizes without adding it).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] | trim }}\n\n"
    "{% elif message['role'] == 'user' %}User: {{ message['content'] | trim }}\n"
    "{% elif message['role'] == 'assistant' %}Assistant: {{ message['content'] | trim }}{{ eos_token }}\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "LlamaTokenizer",
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": None,
        "legacy": False,
        "add_prefix_space": True,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 512,
        "chat_template": CHAT_TEMPLATE,
    }


def train(corpus: Path, out: Path, *, vocab_size: int = VOCAB_SIZE, threads: int = 2) -> Path:
    """Train on `corpus` (one sentence a line, as SentencePiece reads it); returns tokenizer.model."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        spm.SentencePieceTrainer.train(
            input=str(corpus),
            model_prefix=str(Path(tmp) / "tokenizer"),
            model_type="bpe",
            vocab_size=vocab_size,
            character_coverage=1.0,
            # Every printable ASCII character gets its own piece, even if the corpus lacks it
            # (the Bibles spell numbers out, so digits would otherwise be byte-fallback only).
            required_chars="".join(chr(c) for c in range(33, 127)),
            byte_fallback=True,
            split_digits=True,
            allow_whitespace_only_pieces=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=True,
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=-1,
            max_sentence_length=1 << 16,  # WEB paragraphs reach ~5,000 characters
            num_threads=threads,
            minloglevel=2,
        )
        os.replace(Path(tmp) / "tokenizer.model", out / "tokenizer.model")
    _write_json(out / "tokenizer_config.json", tokenizer_config())
    _write_json(
        out / "special_tokens_map.json", {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    )
    return out / "tokenizer.model"


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", type=Path, default=Path("/work/demo_build/corpus/train.txt"))
    ap.add_argument("--out", type=Path, default=Path("/work/demo_build/tokenizer"))
    ap.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = ap.parse_args(argv)
    if not args.corpus.is_file():
        raise SystemExit(f"{args.corpus}: no such file (run prepare_corpus.py first)")

    t0 = time.perf_counter()
    model_path = train(args.corpus, args.out, vocab_size=args.vocab_size)
    sp = spm.SentencePieceProcessor(model_file=str(model_path))
    text = args.corpus.read_text(encoding="utf-8")[:1_000_000]
    n_tokens = len(sp.encode(text))
    print(f"{model_path}: vocab {sp.get_piece_size()}, trained in {time.perf_counter() - t0:.1f} s")
    print(f"{len(text) / n_tokens:.2f} characters per token on the first {len(text):,} characters")
    sample = "In the beginning, God created the heavens and the earth. 1234"
    print(sample, "->", sp.encode(sample, out_type=str))
    if sp.decode(sp.encode(sample)) != sample:
        raise SystemExit(f"{model_path}: decode(encode(text)) != text for {sample!r}")


if __name__ == "__main__":
    main()
