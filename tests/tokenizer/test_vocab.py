"""Tokenizer from GGUF metadata vs the reference implementations (SentencePiece, HF tokenizers).

Each vocabulary is trained here on local text, written through `write_vocab` into a real GGUF file,
read back, and the GGUF-built Tokenizer must give the reference's ids on thousands of varied lines.
"""

from __future__ import annotations

import io
import json
import random
import sysconfig
import time
from pathlib import Path

import gguf
import pytest

from hotcold.convert.vocab import write_vocab
from hotcold.tokenizer.vocab import StreamingDetokenizer, Tokenizer

spm = pytest.importorskip("sentencepiece")

# --------------------------------------------------------------------------- text

_WORDS = {
    "latin": "café naïve Straße Ærøskøbing über façade déjà vu São Paulo Kraków señor jalapeño Ångström øl".split(),
    "greek": "Καλημέρα κόσμε αλφάβητο Ελλάδα φιλοσοφία".split(),
    "cyrillic": "Привет мир Москва ёлка щука съезд быстро".split(),
    "cjk": "東京 中文字符 日本語のテキスト 漢字 北京大学 한국어 텍스트 안녕하세요 ひらがな カタカナ".split(),
    "rtl": "مرحبا بالعالم العربية كتاب שלום עולם עברית ספר".split(),
    "emoji": "😀 👍🏽 🇫🇷 👨‍👩‍👧 🎉🎉 ❤️ 🐍 🚀 ✨ 🤖".split(),
    "misc": "“quotes” ‘single’ — – … € £ ¥ ½ ² ∑ ∞ → ≤ ≥ ≠ © ® ™ ° • ¿ ¡ §".split(),
}
_SPACES = [" ", "  ", "   ", "    ", "\t", " \t ", "\n", "\n\n", "        ", " \n "]


def _stdlib_files() -> list[Path]:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    assert len(files) > 40, "the Python stdlib sources are needed as test text"
    return files


def _lines(files: list[Path], limit: int) -> list[str]:
    out: list[str] = []
    size = 0
    for f in files:
        for line in f.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.strip():
                out.append(line)
                size += len(line)
                if size > limit:
                    return out
    return out


def _unicode_line(rng: random.Random, *, rare: bool = True) -> str:
    parts = []
    for _ in range(rng.randint(1, 12)):
        r = rng.random()
        if not rare and 0.7 <= r < 0.85:
            r = 0.9
        if r < 0.45:
            parts.append(rng.choice(_WORDS[rng.choice(list(_WORDS))]))
        elif r < 0.6:
            parts.append(str(rng.randint(0, 10 ** rng.randint(1, 9))))
        elif r < 0.7:
            parts.append(f"{rng.uniform(-1e4, 1e4):.{rng.randint(0, 5)}f}")
        elif r < 0.8:
            parts.append("".join(chr(rng.randint(0x20, 0x2FFF)) for _ in range(rng.randint(1, 4))))
        elif r < 0.85:
            parts.append("".join(chr(rng.randint(0x1F300, 0x1FAFF)) for _ in range(rng.randint(1, 3))))
        else:
            parts.append(rng.choice(["the", "and", "print", "def", "return", "x", "I", "a"]))
        parts.append(rng.choice(_SPACES) if rng.random() < 0.3 else " ")
    text = "".join(parts)
    if rng.random() < 0.3:
        text = rng.choice(_SPACES) + text
    if rng.random() < 0.5:
        text = text.rstrip()
    return text


def _clean(text: str) -> str:
    # no surrogates (not encodable) and no U+2581 (SentencePiece's own space mark: decode turns it into " ")
    return "".join(c for c in text if not 0xD800 <= ord(c) <= 0xDFFF and c != "\u2581")


@pytest.fixture(scope="module")
def corpus() -> dict[str, list[str]]:
    files = _stdlib_files()
    rng = random.Random(0)
    train = _lines(files[0::2], 2_500_000)
    train += [_clean(_unicode_line(rng, rare=False)) for _ in range(3000)]
    held = _lines(files[1::2], 400_000)
    rng.shuffle(held)
    probe = held[:1500]
    probe += [held[i] + "  " for i in range(1500, 1700)]  # trailing spaces
    probe += ["\n".join(held[i : i + 3]) for i in range(1700, 1900, 3)]  # newlines inside
    probe += [_clean(_unicode_line(rng)) for _ in range(1500)]
    probe += [
        "",
        " ",
        "  ",
        "\t",
        "\n",
        "a",
        " a",
        "  a  ",
        "1234567890",
        "3.14159",
        "😀",
        "👨‍👩‍👧",
        "東京",
        "\u05e9\u05dc\u05d5\u05dd",
    ]
    return {"train": train, "probe": probe}


def _write_gguf(hf_dir: Path, path: Path) -> tuple[str, dict]:
    writer = gguf.GGUFWriter(str(path), "llama")
    kind = write_vocab(writer, hf_dir)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return kind, read_metadata(path)


def read_metadata(path: Path) -> dict:
    """GGUF key -> plain Python value, as the loader hands it to Tokenizer.from_metadata."""
    reader = gguf.GGUFReader(str(path))
    out = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        value = field.contents()
        out[name] = value
    return out


# --------------------------------------------------------------------------- SentencePiece


@pytest.fixture(scope="module")
def spm_pair(corpus, tmp_path_factory):
    hf_dir = tmp_path_factory.mktemp("spm")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus["train"]),
        model_writer=model,
        model_type="bpe",
        vocab_size=3000,
        byte_fallback=True,
        split_digits=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        num_threads=2,
        minloglevel=2,
    )
    (hf_dir / "tokenizer.model").write_bytes(model.getvalue())
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    (hf_dir / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": template, "add_bos_token": True})
    )
    kind, meta = _write_gguf(hf_dir, hf_dir / "vocab.gguf")
    assert kind == "llama"
    ref = spm.SentencePieceProcessor(model_proto=model.getvalue())
    return Tokenizer.from_metadata(meta, source="spm.gguf"), ref, meta, hf_dir


def test_spm_metadata(spm_pair):
    tok, ref, meta, _ = spm_pair
    assert meta["tokenizer.ggml.model"] == "llama"
    assert tok.n_vocab == ref.get_piece_size() == 3000
    assert (tok.bos_id, tok.eos_id, tok.unk_id) == (1, 2, 0)
    assert tok.add_bos and tok.add_space_prefix
    assert tok.chat_template.startswith("{% for m in messages %}")
    types = meta["tokenizer.ggml.token_type"]
    assert types[0] == 2 and types[1] == types[2] == 3
    assert types.count(6) == 256
    assert tok.is_eog(2) and not tok.is_eog(1)


def test_spm_matches_sentencepiece(spm_pair, corpus):
    tok, ref, _, _ = spm_pair
    lines = corpus["probe"]
    mismatches = []
    start = time.perf_counter()
    ours = [tok.encode(line, parse_special=False) for line in lines]
    elapsed = time.perf_counter() - start
    for line, ids in zip(lines, ours):
        want = [ref.bos_id()] + ref.encode(line)
        if ids != want:
            mismatches.append((line, ids, want))
    assert not mismatches, f"{len(mismatches)} of {len(lines)} lines differ, first: {mismatches[0]!r}"
    assert len(lines) > 3000
    byte_tokens = sum(1 for ids in ours for i in ids if 3 <= i < 259)
    assert byte_tokens > 1000, "the probe lines should exercise byte fallback"
    print(f"spm: {len(lines)} lines, {sum(map(len, ours))} tokens identical; encode took {elapsed:.2f} s")


def test_spm_decode_round_trip(spm_pair, corpus):
    tok, ref, _, _ = spm_pair
    for line in corpus["probe"]:
        ids = tok.encode(line, parse_special=False)
        assert tok.decode(ids) == line
        assert tok.decode(ids) == ref.decode(ids)
    assert tok.decode([]) == ""
    assert tok.encode("") == [1]
    assert tok.encode("", add_bos=False) == []


def test_spm_decode_matches_sentencepiece_on_random_ids(spm_pair):
    tok, ref, _, _ = spm_pair
    rng = random.Random(1)
    for _ in range(500):
        ids = [rng.randrange(tok.n_vocab) for _ in range(rng.randint(1, 12))]
        if rng.random() < 0.5:
            ids = [1] + ids
        assert tok.decode(ids) == ref.decode(ids), ids


def test_spm_encode_speed(spm_pair, corpus):
    tok, _, _, _ = spm_pair
    text = "\n".join(corpus["probe"][:400])  # ~ a few thousand tokens
    start = time.perf_counter()
    ids = tok.encode(text)
    elapsed = time.perf_counter() - start
    print(f"spm: {len(text)} chars -> {len(ids)} tokens in {elapsed * 1000:.0f} ms")
    assert len(ids) > 3000
    assert elapsed < 1.0


def test_special_tokens_in_text(spm_pair):
    tok, _, _, _ = spm_pair
    assert tok.encode("<s>hi</s>", add_bos=False)[0] == 1
    assert tok.encode("<s>hi</s>", add_bos=False)[-1] == 2
    assert 1 not in tok.encode("<s>hi", add_bos=False, parse_special=False)
    # the space prefix is added after a special token, as llama.cpp does
    assert tok.encode("<s>hi", add_bos=False) == [1] + tok.encode("hi", add_bos=False)
    assert tok.decode(tok.encode("<s>hi</s>")) == "hi"


def _spm_with_config(spm_pair, tmp_path: Path, config: dict) -> tuple[Tokenizer, dict]:
    """The spm_pair vocabulary written again with another tokenizer_config.json."""
    (tmp_path / "tokenizer.model").write_bytes((spm_pair[3] / "tokenizer.model").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    kind, meta = _write_gguf(tmp_path, tmp_path / "vocab.gguf")
    assert kind == "llama"
    return Tokenizer.from_metadata(meta, source="spm.gguf"), meta


def test_spm_file_without_bos(spm_pair, corpus, tmp_path):
    ref = spm_pair[1]
    tok, meta = _spm_with_config(spm_pair, tmp_path, {"add_bos_token": False})
    assert meta["tokenizer.ggml.add_bos_token"] is False
    assert not tok.add_bos and tok.bos_id == 1
    lines = corpus["probe"][::10]
    assert [tok.encode(line, parse_special=False) for line in lines] == [ref.encode(line) for line in lines]
    assert tok.encode("") == []
    assert tok.encode("<s>hi") == [1] + ref.encode("hi")  # BOS spelled in the text is still BOS


def test_spm_bos_by_default(spm_pair, corpus, tmp_path):
    ref = spm_pair[1]
    tok, meta = _spm_with_config(spm_pair, tmp_path, {})
    assert "tokenizer.ggml.add_bos_token" not in meta
    assert tok.add_bos and not tok.add_eos
    lines = corpus["probe"][::10]
    ours = [tok.encode(line, parse_special=False) for line in lines]
    assert ours == [ref.encode(line, add_bos=True) for line in lines]
    assert [tok.encode(line, add_bos=False, parse_special=False) for line in lines] == ref.encode(lines)
    # the dict-built vocabulary without the key, as a file from another writer
    assert "tokenizer.ggml.add_bos_token" not in _meta()
    assert Tokenizer.from_metadata(_meta()).encode("a") == [1, 3]
    assert Tokenizer.from_metadata(_meta(add_bos_token=False)).encode("a") == [3]


def test_spm_file_with_eos(spm_pair, corpus, tmp_path):
    ref = spm_pair[1]
    tok, meta = _spm_with_config(spm_pair, tmp_path, {"add_bos_token": True, "add_eos_token": True})
    assert meta["tokenizer.ggml.add_eos_token"] is True
    assert tok.add_bos and tok.add_eos
    lines = corpus["probe"][::10]
    ours = [tok.encode(line, parse_special=False) for line in lines]
    assert ours == [ref.encode(line, add_bos=True, add_eos=True) for line in lines]
    assert tok.encode("") == [1, 2]
    # opting out: add_bos=False drops both (llama.cpp's add_special), add_eos alone drops or keeps EOS
    assert tok.encode("hi", add_bos=False) == ref.encode("hi")
    assert tok.encode("hi", add_eos=False) == ref.encode("hi", add_bos=True)
    assert tok.encode("hi", add_bos=False, add_eos=True) == ref.encode("hi", add_eos=True)
    # a file that does not ask for EOS gets none even when the caller allows it
    assert spm_pair[0].encode("hi", add_eos=True) == ref.encode("hi", add_bos=True)
    assert Tokenizer.from_metadata(_meta(add_eos_token=True)).encode("a") == [1, 3, 2]


# --------------------------------------------------------------------------- byte-level BPE


def _bpe_pre_tokenizer(kind: str):
    from tokenizers import Regex, pre_tokenizers

    from hotcold.tokenizer.vocab import LLAMA3_REGEX

    if kind == "gpt-2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if kind == "falcon":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Punctuation(behavior="contiguous"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
                pre_tokenizers.Digits(individual_digits=False),
                pre_tokenizers.Split(Regex("[0-9][0-9][0-9]"), behavior="isolated"),
            ]
        )
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


@pytest.fixture(scope="module", params=["gpt-2", "falcon", "llama-bpe"])
def bpe_pair(request, corpus, tmp_path_factory):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    pre = request.param
    hf_dir = tmp_path_factory.mktemp("bpe")
    hf = HFTokenizer(models.BPE(ignore_merges=pre == "llama-bpe"))
    hf.pre_tokenizer = _bpe_pre_tokenizer(pre)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=3000,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(corpus["train"][::2], trainer=trainer)
    hf.save(str(hf_dir / "tokenizer.json"))
    config = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "add_bos_token": False}
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(config))
    (hf_dir / "config.json").write_text(json.dumps({"vocab_size": 3008}))
    kind, meta = _write_gguf(hf_dir, hf_dir / "vocab.gguf")
    assert kind == "gpt2"
    assert meta["tokenizer.ggml.pre"] == pre
    return Tokenizer.from_metadata(meta, source="bpe.gguf"), hf, meta, hf_dir


def test_bpe_matches_tokenizers(bpe_pair, corpus):
    tok, hf, meta, _ = bpe_pair
    assert tok.n_vocab == 3008  # padded to config.json's vocab_size
    assert meta["tokenizer.ggml.token_type"][-1] == 5
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (0, 2, False)
    assert tok.is_eog(2) and tok.is_eog(0)
    lines = corpus["probe"]
    start = time.perf_counter()
    ours = [tok.encode(line, add_bos=False, parse_special=False) for line in lines]
    elapsed = time.perf_counter() - start
    mismatches = [(line, ids) for line, ids in zip(lines, ours) if ids != hf.encode(line).ids]
    assert not mismatches, f"{len(mismatches)} of {len(lines)} lines differ, first: {mismatches[0]!r}"
    for line, ids in zip(lines, ours):
        assert tok.decode(ids) == line
    assert tok.encode("<|im_start|>hi<|im_end|>", add_bos=False) == [1] + hf.encode("hi").ids + [2]
    assert tok.decode(tok.encode("<|im_start|>hi<|im_end|>")) == "hi"
    print(
        f"bpe {tok.pre}: {len(lines)} lines, {sum(map(len, ours))} tokens identical; encode took {elapsed:.2f} s"
    )


def test_bpe_bos_default_follows_llama_cpp(bpe_pair, corpus):
    tok, hf, meta, _ = bpe_pair
    assert meta["tokenizer.ggml.add_bos_token"] is False
    assert tok.encode("hi") == hf.encode("hi").ids  # the file says no BOS
    # without the key llama.cpp adds a BOS only for Llama-3-style pre-tokenizers
    meta = {k: v for k, v in meta.items() if k != "tokenizer.ggml.add_bos_token"}
    tok = Tokenizer.from_metadata(meta)
    want_bos = [tok.bos_id] if meta["tokenizer.ggml.pre"] == "llama-bpe" else []
    assert tok.add_bos == bool(want_bos) and not tok.add_eos
    for line in corpus["probe"][:200]:
        assert tok.encode(line, parse_special=False) == want_bos + hf.encode(line).ids
    tok = Tokenizer.from_metadata(
        {**meta, "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": True}
    )
    assert tok.encode("hi") == [0] + hf.encode("hi").ids + [2]


# --------------------------------------------------------------------------- streaming


def _random_ids(tok: Tokenizer, rng: random.Random, corpus_lines: list[str]) -> list[int]:
    r = rng.random()
    if r < 0.4:  # real text: emoji and CJK split across byte tokens
        return tok.encode(rng.choice(corpus_lines), add_bos=rng.random() < 0.5, parse_special=False)
    ids = []
    for _ in range(rng.randint(1, 30)):
        c = rng.random()
        if c < 0.5 and tok.kind == "llama":
            ids.append(rng.randrange(3, 259))  # byte tokens, often not valid UTF-8 alone
        elif c < 0.6:
            ids.append(rng.choice([x for x in (tok.bos_id, tok.eos_id) if x is not None]))
        else:
            ids.append(rng.randrange(tok.n_vocab))
    return ids


def test_streaming_matches_decode(spm_pair, bpe_pair, corpus):
    rng = random.Random(7)
    emoji = [line for line in corpus["probe"] if any(ord(c) > 0xFFFF for c in line)]
    assert emoji
    for tok in (spm_pair[0], bpe_pair[0]):
        for _ in range(400):
            ids = _random_ids(tok, rng, emoji)
            detok = StreamingDetokenizer(tok)
            parts = [detok.add(i) for i in ids]
            assert "".join(parts) + detok.flush() == tok.decode(ids), ids
            # nothing emitted early is ever revised: each partial stream starts the full decode
            full = tok.decode(ids)
            assert all(full.startswith("".join(parts[:k])) for k in range(len(parts)))


def test_streaming_emits_whole_characters(spm_pair):
    tok = spm_pair[0]
    text = "\U0001f9a9 東京 😀 \u2fd5"  # the flamingo and the radical are not in the vocabulary
    ids = tok.encode(text)
    detok = StreamingDetokenizer(tok)
    parts = [detok.add(i) for i in ids]
    assert "".join(parts) + detok.flush() == text
    assert all("\ufffd" not in p for p in parts)
    first_byte = next(k for k, i in enumerate(ids) if 3 <= i < 259)
    assert tok.token_bytes(ids[first_byte]) == "\U0001f9a9".encode()[:1]
    # the four bytes wait until the character is whole
    assert parts[first_byte : first_byte + 4] == ["", "", "", "\U0001f9a9"]


def test_streaming_after_a_prompt_keeps_the_space(spm_pair):
    tok = spm_pair[0]
    prompt = tok.encode("Once upon a time")
    full = tok.encode("Once upon a time there was a \U0001f9a9")
    assert full[: len(prompt)] == prompt
    detok = StreamingDetokenizer(tok, prompt_ids=prompt)
    text = "".join(detok.add(i) for i in full[len(prompt) :]) + detok.flush()
    assert text == " there was a \U0001f9a9"
    alone = StreamingDetokenizer(tok)
    assert "".join(alone.add(i) for i in full[len(prompt) :]) + alone.flush() == "there was a \U0001f9a9"


def test_token_bytes(spm_pair, bpe_pair):
    tok = spm_pair[0]
    assert tok.token_bytes(1) == b""  # control
    assert tok.token_bytes(3 + 0x41) == b"A"  # <0x41>
    space_piece = tok.encode(" x", add_bos=False)[0]
    assert tok.token_bytes(space_piece).startswith(b" ")
    btok = bpe_pair[0]
    ids = btok.encode(" héllo", add_bos=False)
    assert b"".join(btok.token_bytes(i) for i in ids) == " héllo".encode()


# --------------------------------------------------------------------------- bad input


def _meta(**over):
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>", "\u2581a", "a"],
        "tokenizer.ggml.scores": [0.0, 0.0, 0.0, -1.0, -2.0],
        "tokenizer.ggml.token_type": [2, 3, 3, 1, 1],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }
    for key, value in over.items():
        key = "tokenizer.ggml." + key
        if value is None:
            meta.pop(key)
        else:
            meta[key] = value
    return meta


def test_tiny_vocab_without_byte_tokens():
    tok = Tokenizer.from_metadata(_meta(unknown_token_id=0))
    assert tok.encode("a a") == [1, 3, 3]
    assert tok.encode("aé€a", add_bos=False) == [3, 0, 4]  # a run of unknown characters is one <unk>
    assert tok.decode([3, 0, 4]) == "a \u2047 a"


@pytest.mark.parametrize(
    "over, key",
    [
        ({"tokens": None}, "tokenizer.ggml.tokens"),
        ({"model": "wordpiece"}, "tokenizer.ggml.model"),
        ({"model": None}, "tokenizer.ggml.model"),
        ({"scores": [0.0]}, "tokenizer.ggml.scores"),
        ({"token_type": [1, 1]}, "tokenizer.ggml.token_type"),
        ({"bos_token_id": 99}, "tokenizer.ggml.bos_token_id"),
        ({"model": "gpt2"}, "tokenizer.ggml.merges"),
    ],
)
def test_bad_metadata(over, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")) as info:
        Tokenizer.from_metadata(_meta(**over), source="bad.gguf")
    assert str(info.value).startswith("bad.gguf: ")
    if over.get("model") == "wordpiece":
        assert "llama" in str(info.value) and "gpt2" in str(info.value)


def test_write_vocab_from_vocab_json_and_merges_txt(bpe_pair, tmp_path):
    tok, hf, meta, _ = bpe_pair
    if tok.pre != "gpt-2":
        pytest.skip("GPT-2's own files imply the GPT-2 pre-tokenizer")
    hf.model.save(str(tmp_path))  # vocab.json + merges.txt
    decoder = {
        str(i): {"content": t, "special": True}
        for i, t in enumerate(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    }
    config = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "add_bos_token": False}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "added_tokens_decoder": decoder}))
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 3008}))
    kind, meta2 = _write_gguf(tmp_path, tmp_path / "gpt2.gguf")
    assert kind == "gpt2"
    for key in (
        "model",
        "pre",
        "tokens",
        "token_type",
        "merges",
        "bos_token_id",
        "eos_token_id",
        "add_bos_token",
    ):
        assert meta2["tokenizer.ggml." + key] == meta["tokenizer.ggml." + key], key


def test_write_vocab_prefers_sentencepiece(spm_pair, bpe_pair, tmp_path):
    (tmp_path / "tokenizer.model").write_bytes((spm_pair[3] / "tokenizer.model").read_bytes())
    (tmp_path / "tokenizer.json").write_bytes((bpe_pair[3] / "tokenizer.json").read_bytes())
    kind, meta = _write_gguf(tmp_path, tmp_path / "both.gguf")
    assert kind == "llama" and meta["tokenizer.ggml.tokens"] == spm_pair[2]["tokenizer.ggml.tokens"]


def test_write_vocab_without_tokenizer(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "llama")
    with pytest.raises(ValueError, match=str(tmp_path)):
        write_vocab(writer, tmp_path)


def test_lone_surrogates_become_replacement_characters(spm_pair, bpe_pair):
    """A lone surrogate (e.g. a JSON "\\ud800" escape) is no character and has no UTF-8: each is encoded as
    U+FFFD instead of raising UnicodeEncodeError deep in the encoder."""
    for tok in (spm_pair[0], bpe_pair[0]):
        for text in ("\ud800abc", "abc\udfff", "a\udcff b\ud800<|im_end|>"):
            fixed = "".join("\ufffd" if 0xD800 <= ord(c) <= 0xDFFF else c for c in text)
            assert tok.encode(text) == tok.encode(fixed)
        assert tok.decode(tok.encode("x\udc80y", add_bos=False)) == "x\ufffdy"


# --------------------------------------------------------------------------- end of generation


def _vocab_meta(tokens: list[str], types: list[int], **ids) -> dict:
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * len(tokens),
        "tokenizer.ggml.token_type": types,
        **{f"tokenizer.ggml.{k}": v for k, v in ids.items()},
    }


@pytest.mark.parametrize(
    "tokens, types, ids, eog",
    [
        # Llama 3.1: EOS, <|eot_id|> and <|eom_id|> by text; a normal "<|end|>" too (any type counts upstream)
        (["<s>", "<|end_of_text|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "a"], [3, 3, 3, 3, 1, 1],
         {"eos_token_id": 1}, {1, 2, 3, 4}),
        # gpt-oss: <|return|> and <|call|> end turns, so <|end|> does not
        (["<|endoftext|>", "<|return|>", "<|call|>", "<|end|>", "a"], [3, 3, 3, 3, 1], {"eos_token_id": 1}, {0, 1, 2}),
        # Solar Open: <|calls|> and <|flush|>, likewise
        (["<|endoftext|>", "<|calls|>", "<|flush|>", "<|end|>"], [3, 3, 3, 3], {}, {0, 1, 2}),
        # FIM tokens by key, else by text (the first of each list): Qwen2.5-Coder's <|fim_pad|>, <|repo_name|>,
        # <|file_sep|>; not <|fim_prefix|>
        (["<|fim_prefix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "x"], [3, 3, 3, 3, 1], {}, {1, 2, 3}),
        (["<s>", "</s>", "pad", "rep", "sep"], [3, 3, 3, 3, 3],
         {"eos_token_id": 1, "fim_pad_token_id": 2, "fim_rep_token_id": 3, "fim_sep_token_id": 4}, {1, 2, 3, 4}),
        # EOT / EOM by key, whatever their text; "</s>" dropped where <|tool_response> ends turns (Gemma 4)
        (["<s>", "</s>", "<|tool_response>", "<my_eot>", "<my_eom>"], [3, 1, 3, 3, 3],
         {"eot_token_id": 3, "eom_token_id": 4}, {2, 3, 4}),
    ],
)  # fmt: skip
def test_end_of_generation_tokens_follow_llama_cpps_rules(tokens, types, ids, eog):
    tok = Tokenizer.from_metadata(_vocab_meta(tokens, types, **ids))
    assert tok.eog_ids == eog
