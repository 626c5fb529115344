"""Shared builders for tests, made offline: tiny Hugging Face checkpoints with real tokenizers, tiny model
files written directly, and the layout of a GGUF header (to break one field on purpose)."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

TOKENIZER_VOCAB = 512


def training_text() -> str:
    # varied English-like text from the Python standard library's docstrings: always present, offline
    import argparse
    import collections
    import email
    import json as json_mod

    parts = [m.__doc__ or "" for m in (email, json_mod, argparse, collections, Path, torch.nn.Module)]
    parts += [f"Line {i}: the quick brown fox {i * 7} jumps over {i % 13} lazy dogs." for i in range(400)]
    return "\n".join(parts)


def write_tokenizer(hf_dir: Path, spm_model: Path) -> None:
    (hf_dir / "tokenizer.model").write_bytes(spm_model.read_bytes())
    (hf_dir / "tokenizer_config.json").write_text(
        json.dumps({"add_bos_token": True, "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    )


def make_llama(hf_dir: Path, spm_model: Path, *, seed: int = 0, **overrides):
    """Save a tiny random LlamaForCausalLM (fp32) with the test tokenizer; returns the HF model in eval mode.
    n_ff 1280: above 1000 and a multiple of 256, as PowerInfer's kernels require."""
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = dict(
        vocab_size=TOKENIZER_VOCAB,
        hidden_size=64,
        intermediate_size=1280,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        hidden_act="relu",
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**settings)).eval()
    scale_matrices(model)
    save_checkpoint(model, hf_dir, spm_model)
    return model


def scale_matrices(model, factor: float = 2.0) -> None:
    """Random init is too tame: scaled weight matrices make logits and activations non-trivial."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(factor)


def save_checkpoint(model, hf_dir: Path, spm_model: Path) -> None:
    """A Hugging Face checkpoint folder: safetensors weights, config.json and the test tokenizer."""
    hf_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(hf_dir, safe_serialization=True)
    write_tokenizer(hf_dir, spm_model)


def write_predictors(
    pred_dir: Path,
    n_layer: int,
    n_embd: int,
    n_ff: int,
    *,
    rank: int = 16,
    all_fire: bool = False,
    seed: int = 0,
    threshold: float | None = None,
) -> Path:
    """PowerInfer predictor folder. all_fire: fc2 = 0, so every logit is 0 >= threshold 0 and all neurons fire."""
    pred_dir.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    for i in range(n_layer):
        fc1 = torch.randn(rank, n_embd, generator=gen) / n_embd**0.5
        fc2 = torch.zeros(n_ff, rank) if all_fire else torch.randn(n_ff, rank, generator=gen) / rank**0.5
        torch.save({"fc1.weight": fc1, "fc2.weight": fc2}, pred_dir / f"model_{i}.pt")
    if threshold is not None:
        (pred_dir / "config.json").write_text(json.dumps({"sparse_threshold": threshold}))
    return pred_dir


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """transformers' fp32 logits of every position."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def random_ids(n: int, seed: int = 1) -> list[int]:
    return torch.randint(3, TOKENIZER_VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_logits_match(llm, hf, ids: list[int], rel: float = 1e-4) -> None:
    """hotcold's logits equal transformers' within rel of the logit scale (which must be non-trivial)."""
    ours, ref = llm.logits(ids), hf_logits(hf, ids)
    scale = ref.abs().max()
    assert scale > 1.0, "test model too tame to be a meaningful comparison"
    assert (ours - ref).abs().max() <= rel * scale


def assert_greedy_matches(llm, hf, prompt_text: str = "Line 3: the quick brown fox", n: int = 32) -> None:
    """n greedy tokens from the KV-cached engine equal transformers' generate."""
    from hotcold.runtime.sampling import SamplingParams

    prompt = llm.tokenize(prompt_text)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    steps = llm.engine.generate_step(prompt, SamplingParams())
    assert [next(steps) for _ in range(n)] == ref[0, len(prompt) :].tolist()


class _LayerRecord(dict):
    """{"input": predictor input [T, D], "mask": [T, F]} of one layer's last sparse call, read from the
    sequence state when the test looks at it."""

    def __init__(self, seq, layer: int):
        super().__init__()
        self.seq, self.layer = seq, layer

    def __getitem__(self, key):
        p, mask = self.seq.masks[self.layer]
        return {"input": p, "mask": mask}[key]


def record_masks(llm) -> list[dict]:
    """Ask the model's sequence to keep every layer's predictor input and mask (seq.keep_masks)."""
    seq = llm.engine.seq
    seq.keep_masks = True
    return [_LayerRecord(seq, i) for i in range(len(llm.loaded.model.layers))]


def ffn_weights(f: int, d: int, kind="gated", dtype=torch.float32, *, seed=0, bias=False, scale=6.0):
    """Random FFN weights of one layer: up, gate (not for "plain"), down_t ~ N(0, 1/scale^2) in `dtype`,
    and float32 biases on request."""
    from hotcold.sparse.ffn_weights import FFNWeights

    g = torch.Generator().manual_seed(seed)
    w = lambda *s: (torch.randn(*s, generator=g) / scale).to(dtype)  # noqa: E731
    return FFNWeights(
        up=w(f, d),
        gate=None if kind == "plain" else w(f, d),
        down_t=w(f, d),
        up_bias=torch.randn(f, generator=g) if bias else None,
        down_bias=torch.randn(d, generator=g) if bias else None,
        kind=kind,
    )


class _FFNState:
    """A one-sequence batch for calling FFNs directly (no KV cache: FFNs never touch it); `.counts` are the
    sequence's per-layer neuron counts."""

    def __new__(cls, n_layer: int = 1, *, dense: bool = False, observe=None):
        from hotcold.runtime.state import Batch, FFNCounts, SequenceState

        seq = SequenceState(None, [FFNCounts() for _ in range(n_layer)], dense=dense, observe=observe)
        batch = Batch.single(seq, 0, 0)
        batch.counts = seq.counts
        return batch


ffn_state = _FFNState


def run_family_checks(
    path, hf, *, greedy: bool = True, rel: float = 1e-4, decoder: str = "cpu_one_call"
) -> None:
    """The checks every family passes, run the same way for each (as mlx-lm's shared model runner):
    logits == transformers' on 40 random tokens; greedy tokens == transformers' generate (unless greedy is
    False); cached decode == one full forward; a generation split in two == the same generation in one go
    (the second half reuses the cached prefix); a batch of sequences == each alone; the decoder chosen at load
    on the CPU is `decoder`, and its decode steps give the eager decoder's logits and greedy tokens."""
    import hotcold

    llm = hotcold.load(path, device="cpu")
    # float32 files decode layer by layer (torch multiplies float32); the decoder chosen for the F16 copy
    from hotcold.convert.quantize import quantize_file

    assert llm.decoder in ("eager", decoder), llm.loaded.notes
    f16 = Path(path).with_suffix(".decoder-f16.gguf")
    if not f16.exists():
        quantize_file(path, f16, "f16")
    fast = hotcold.load(f16, device="cpu")
    assert fast.decoder == decoder, fast.loaded.notes
    check_decoder_equals_eager(fast, hotcold.load(f16, device="cpu", decoder="eager"))
    assert_logits_match(llm, hf, random_ids(40), rel)
    if greedy:
        assert_greedy_matches(llm, hf)

    check_cache_split_batch(llm, llm.tokenize("Line 12: the"), tokens=16, atol=rel)


def check_cache_split_batch(llm, prompt: list[int], *, tokens: int, atol: float, rtol: float = 1e-5) -> None:
    """Cached decode == one full forward (within atol x the logit scale); a generation of `tokens` from `prompt`
    split in two == the same in one go (the second half reuses the cached prefix); a batch of sequences (one
    forward for all, each over its own cache) == each alone."""
    from hotcold.runtime.sampling import SamplingParams

    ids = random_ids(24, seed=2)
    full = llm.logits(ids)
    engine = llm.engine
    engine.cached_ids = []
    stepwise = [engine.prefill(ids[:10])]
    for pos in range(10, 24):
        stepwise.append(engine.forward([ids[pos]], pos, last_only=True)[-1])
    assert torch.allclose(torch.stack(stepwise), full[9:], rtol=rtol, atol=atol * full.abs().max())

    steps = engine.generate_step(prompt, SamplingParams())
    first = [next(steps) for _ in range(tokens)]
    steps.close()
    half = tokens // 2
    steps = engine.generate_step(prompt + first[:half], SamplingParams())
    assert [next(steps) for _ in range(half)] == first[half:]

    prompts = [random_ids(n, seed=10 + n) for n in (3, 7, 12)]
    alone = [llm.generate(p, max_tokens=6, ignore_eos=True) for p in prompts]
    assert llm.generate_batch(prompts, max_tokens=6, ignore_eos=True) == alone


def decode_logits(llm, ids: list[int], split: int) -> torch.Tensor:
    """The prompt ids[:split], then one token a step (the decoder's steps): each position's logits from split-1 on."""
    engine = llm.engine
    engine.truncate(0)
    out = [engine.prefill(ids[:split])]
    with torch.inference_mode():
        for pos in range(split, len(ids)):
            out.append(engine.forward([ids[pos]], pos, last_only=True)[-1])
    return torch.stack(out)


def check_decoder_equals_eager(llm, eager, rel: float = 1e-5) -> None:
    """`llm`'s decoder (chosen at load) against the eager decoder on the same file: decode-step logits within
    `rel` of the logit scale, the same greedy tokens, and the same for a batch of sequences decoding together."""
    assert eager.decoder == "eager"
    ids = random_ids(20, seed=3)
    fast, slow = decode_logits(llm, ids, 6), decode_logits(eager, ids, 6)
    if llm.decoder == "cpu_one_call":  # it ran them all, not the layers
        assert llm.loaded.model.cpu_decode.steps == len(ids) - 6
    assert torch.allclose(fast, slow, rtol=0, atol=rel * slow.abs().max()), (fast - slow).abs().max()
    prompts = [random_ids(n, seed=20 + n) for n in (2, 5, 9)]
    assert [llm.generate(p, max_tokens=8, ignore_eos=True) for p in prompts] == [
        eager.generate(p, max_tokens=8, ignore_eos=True) for p in prompts
    ]
    assert llm.generate_batch(prompts, max_tokens=8, ignore_eos=True) == eager.generate_batch(
        prompts, max_tokens=8, ignore_eos=True
    )


# ---------------------------------------------------------------------------------------------------
# GGUF layout: where every header field of a valid file is (to break one on purpose)


@dataclass(frozen=True)
class GGUFField:
    offset: int
    fmt: str  # struct format of the field: "Q", "I", "f", ...
    role: str  # "version", "count", "length", "type", "value" (a scalar key), "item" (an array element),
    # "n_dims", "dim", "offset"
    label: str


def gguf_layout(data: bytes) -> tuple[list[GGUFField], int]:
    """Every field of the file's header, and where its data section starts."""
    fields: list[GGUFField] = []
    pos = 4

    def read(fmt: str, role: str, label: str):
        nonlocal pos
        value = struct.unpack_from("<" + fmt, data, pos)[0]
        fields.append(GGUFField(pos, fmt, role, label))
        pos += struct.calcsize("<" + fmt)
        return value

    def string(label: str) -> bytes:
        nonlocal pos
        n = read("Q", "length", label)
        s = data[pos : pos + n]
        pos += n
        return s

    scalar = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
    read("I", "version", "version")
    n_tensors = read("Q", "count", "tensor count")
    n_kv = read("Q", "count", "kv count")
    alignment = 32
    for _ in range(n_kv):
        key = string("key").decode()
        vtype = read("I", "type", f"{key} type")
        if vtype == 8:
            string(f"{key} string")
        elif vtype in scalar:
            value = read(scalar[vtype], "value", key)
            if key == "general.alignment":
                alignment = value
        else:  # array
            itype = read("I", "type", f"{key} item type")
            count = read("Q", "count", f"{key} count")
            for j in range(count):
                if itype == 8:
                    string(f"{key}[{j}]")
                else:
                    read(scalar[itype], "item", f"{key}[{j}]")
    for _ in range(n_tensors):
        name = string("tensor name").decode()
        n_dims = read("I", "n_dims", f"{name} n_dims")
        for d in range(n_dims):
            read("Q", "dim", f"{name} dim {d}")
        read("I", "type", f"{name} type")
        read("Q", "offset", f"{name} offset")
    return fields, pos + (-pos % alignment)


def set_field(buf: bytearray, field: GGUFField, value) -> None:
    fmt = "<" + field.fmt
    if field.fmt in "BHIQ":
        value = int(value) % (1 << (8 * struct.calcsize(fmt)))
    elif field.fmt in "bhiq":
        bits = 8 * struct.calcsize(fmt)
        value = (int(value) + (1 << (bits - 1))) % (1 << bits) - (1 << (bits - 1))
    elif field.fmt == "?":
        value = int(value) & 0xFF
        fmt = "<B"
    struct.pack_into(fmt, buf, field.offset, value)


def get_field(data: bytes, field: GGUFField):
    return struct.unpack_from("<" + field.fmt, data, field.offset)[0]


# ---------------------------------------------------------------------------------------------------
# A tiny model file written directly (no Hugging Face checkpoint): fast to make, for file-level tests


def tiny_gguf(path: Path, *, sparse: bool) -> Path:
    """A 2-layer llama (n_embd 32, 4 heads, 2 KV heads, n_ff 64) with a 270-token SentencePiece-style
    vocabulary, tensors in several types (F32, F16, Q8_0, Q4_0), written by hotcold's own writer."""
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFValueType as V

    from hotcold.gguf import quants
    from hotcold.gguf.io import TensorSpec, write_model_file

    rng = torch.Generator().manual_seed(1 + sparse)
    D, F, H, HKV, L = 32, 64, 4, 2, 2
    Dh = D // H
    pieces = ["▁the", "▁a", "▁fox", "▁dog", "e", "t", "a", "o", "▁", "s", "h"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(pieces))]
    n_vocab = len(tokens)
    meta = [
        ("general.name", "fuzz", V.STRING),
        ("llama.block_count", L, V.UINT32),
        ("llama.context_length", 64, V.UINT32),
        ("llama.embedding_length", D, V.UINT32),
        ("llama.feed_forward_length", F, V.UINT32),
        ("llama.attention.head_count", H, V.UINT32),
        ("llama.attention.head_count_kv", HKV, V.UINT32),
        ("llama.attention.layer_norm_rms_epsilon", 1e-5, V.FLOAT32),
        ("llama.rope.dimension_count", Dh, V.UINT32),
        ("llama.rope.freq_base", 10000.0, V.FLOAT32),
        ("tokenizer.ggml.model", "llama", V.STRING),
        ("tokenizer.ggml.tokens", tokens, V.ARRAY),
        ("tokenizer.ggml.scores", scores, V.ARRAY),
        ("tokenizer.ggml.token_type", types, V.ARRAY),
        ("tokenizer.ggml.bos_token_id", 1, V.UINT32),
        ("tokenizer.ggml.eos_token_id", 2, V.UINT32),
        ("tokenizer.ggml.unknown_token_id", 0, V.UINT32),
        ("tokenizer.ggml.add_bos_token", True, V.BOOL),
    ]
    if sparse:
        meta.append(("powerinfer.sparse_threshold", 0.0, V.FLOAT32))
    else:
        meta.append(("hotcold.ffn_activation", "relu", V.STRING))

    def spec(name, shape, qtype):
        values = torch.randn(*shape, generator=rng) * 0.3
        if qtype == Q.F32:
            return TensorSpec(name, shape, qtype, lambda v=values: v.numpy())
        if qtype == Q.F16:
            return TensorSpec(name, shape, qtype, lambda v=values: v.half().numpy())
        return TensorSpec(name, shape, qtype, lambda v=values, q=qtype: quants.quantize(v, q))

    specs = [spec("token_embd.weight", (n_vocab, D), Q.F16)]
    for i in range(L):
        specs += [
            spec(f"blk.{i}.attn_norm.weight", (D,), Q.F32),
            spec(f"blk.{i}.attn_q.weight", (H * Dh, D), Q.Q8_0),
            spec(f"blk.{i}.attn_k.weight", (HKV * Dh, D), Q.Q8_0),
            spec(f"blk.{i}.attn_v.weight", (HKV * Dh, D), Q.F16),
            spec(f"blk.{i}.attn_output.weight", (D, H * Dh), Q.Q4_0),
            spec(f"blk.{i}.ffn_norm.weight", (D,), Q.F32),
            spec(f"blk.{i}.ffn_gate.weight", (F, D), Q.F16),
            spec(f"blk.{i}.ffn_up.weight", (F, D), Q.Q8_0),
        ]
        if sparse:
            specs.append(spec(f"blk.{i}.ffn_down_t.weight", (F, D), Q.F16))
        else:
            specs.append(spec(f"blk.{i}.ffn_down.weight", (D, F), Q.F16))
    specs += [spec("output_norm.weight", (D,), Q.F32), spec("output.weight", (n_vocab, D), Q.Q8_0)]
    if sparse:
        for i in range(L):
            specs += [
                spec(f"blk.{i}.fc1.weight", (16, D), Q.F32),
                spec(f"blk.{i}.fc2.weight", (F, 16), Q.F16),
            ]
    return write_model_file(path, "llama", meta, specs, sparse=sparse)


# Byte offsets of the fp16 fields (scale d, then min / dmin where the type has one) in a ggml block.
FP16_FIELDS = {
    "Q8_0": (0,),
    "Q4_0": (0,),
    "Q5_0": (0,),
    "Q4_1": (0, 2),
    "Q5_1": (0, 2),
    "IQ4_NL": (0,),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "IQ4_XS": (0,),
    "MXFP4": (),  # its scale is one E8M0 byte (E8M0_FIELDS)
}


E8M0_FIELDS = {"MXFP4": 0}  # offset of the one-byte power-of-two scale 2^(e - 128) (ggml's E8M0 "half")


def random_blocks(qtype, n: int, rng: np.random.Generator) -> np.ndarray:
    """Random block bytes of a ggml type with fp16 fields spanning fp16's range: tiny (subnormal),
    huge, zero and -0 scales, and an all-zero block; never NaN or inf (their payloads are not part of
    ggml's arithmetic)."""
    import gguf

    qtype = gguf.GGMLQuantizationType(qtype)
    _, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    for k, off in enumerate(FP16_FIELDS[qtype.name]):
        values = (rng.standard_normal(n) * 10.0 ** rng.integers(-7, 5, n)).astype(np.float16)
        if k == 0:
            values[:4] = np.array([0.0, -0.0, 65504.0, 6e-8], dtype=np.float16)  # zero, -0, max, subnormal
        raw[:, off : off + 2] = values.view(np.uint8).reshape(n, 2)
    if qtype.name in E8M0_FIELDS:  # the power-of-two scale byte: finite values only (e 250: 12 * 2^122)
        off = E8M0_FIELDS[qtype.name]
        raw[:, off] = rng.integers(0, 250, n)
        raw[:4, off] = [0, 1, 127, 249]  # the two subnormal scales, 2^-1, the largest kept
    raw[4] = 0  # an all-zero block
    return raw


@dataclass
class SwigluFiles:
    hf: object  # the transformers model (eval mode, fp32)
    corpus: Path
    dense: dict  # outtype -> dense GGUF path
    sparse: dict  # outtype -> sparsified path (target 0.5)
    tokens: int  # calibration tokens


def swiglu_files(folder: Path, spm_model: Path, *, sparsity: float = 0.5, tokens: int = 3000) -> SwigluFiles:
    from hotcold.convert import convert
    from hotcold.convert.sparsify import sparsify_file

    hf = make_llama(folder / "hf", spm_model, hidden_act="silu")
    corpus = folder / "corpus.txt"
    corpus.write_text(training_text())
    dense, sparse = {}, {}
    for outtype in ("f16", "q8_0"):
        dense[outtype] = convert(folder / "hf", None, folder / f"swiglu.{outtype}.gguf", outtype=outtype)
        sparse[outtype] = folder / f"swiglu.{outtype}.sparse.gguf"
        sparsify_file(
            dense[outtype],
            sparse[outtype],
            corpus,
            sparsity=sparsity,
            max_tokens=tokens,
            method="cats",
            probe="none",
        )
    return SwigluFiles(hf, corpus, dense, sparse, tokens)


def with_activation_stats(model: Path, folder: Path, *, high: int = 1000) -> tuple[Path, list[torch.Tensor]]:
    """A copy of a 2-layer, 1280-neuron model in `folder` with random activation counts in [0, high) beside it
    (folder/activation/activation_{i}.pt, as `hotcold profile` writes them): (the copy, the counts)."""
    import shutil

    path = folder / "m.powerinfer.gguf"
    shutil.copy(model, path)
    (folder / "activation").mkdir()
    g = torch.Generator().manual_seed(0)
    counts = [torch.randint(0, high, (1280,), generator=g) for _ in range(2)]
    for i, c in enumerate(counts):
        torch.save(c, folder / "activation" / f"activation_{i}.pt")
    return path, counts


def llama_perplexity(binary: Path, model: Path, text: Path, *, ctx: int, chunks: int) -> float:
    """`llama-perplexity` on `model` over `text` (context ctx, `chunks` chunks, 2 threads): its estimate after the
    last chunk, the `[chunks]PPL` it prints (the same figure as its "Final estimate" line). On a loaded machine
    llama.cpp's log thread sometimes loses its last lines when the process exits (exit code 0, seen about one run
    in three with four test processes on two cores): then it is run again, three times at most."""
    import re
    import subprocess

    cmd = [str(binary), "-m", str(model), "-f", str(text), "-c", str(ctx), "--chunks", str(chunks),
           "-t", "2", "-b", str(ctx)]  # fmt: skip
    for _ in range(3):
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        out = res.stdout + res.stderr
        assert res.returncode == 0, out[-2000:]
        found = re.findall(rf"\[{chunks}\]([0-9.]+)", out)
        if found:
            return float(found[-1])
    raise AssertionError(f"llama-perplexity printed no estimate for chunk {chunks}:\n{out[-2000:]}")


def check_sparsify_reaches(
    dense: Path, folder: Path, *, attention: bool, decoder: str, max_tokens: int = 2000
):
    """The checks `hotcold sparsify` passes on each family's dense file (at 0.5, on the training text): the decoder
    load chooses is `decoder` and, where it is not the eager one, gives the eager decoder's greedy tokens; about
    half of the FFN neurons are skipped; at sparsity 0 (every neuron and input channel) the logits are the dense
    file's. Returns the sparsified file."""
    import hotcold
    from hotcold.convert.sparsify import sparsify_file

    corpus = folder / "corpus.txt"
    corpus.write_text(training_text())
    out = folder / "m.sparse.gguf"
    sparsify_file(dense, out, corpus, sparsity=0.5, max_tokens=max_tokens, threads=2, attention=attention)
    llm = hotcold.load(out, device="cpu", threads=2)
    assert llm.decoder == decoder, llm.loaded.notes
    prompt, kwargs = [1, 17, 230, 45, 9], dict(max_tokens=10, ignore_eos=True)
    tokens = llm.generate(prompt, **kwargs)
    if decoder != "eager":
        assert tokens == hotcold.load(out, device="cpu", threads=2, decoder="eager").generate(
            prompt, **kwargs
        )
    computed, total = llm.engine.seq.neuron_totals()
    assert 0.3 < computed / total < 0.7, computed / total  # about half of the FFN skipped
    ids = [1, 5, 9, 13, 200]
    full = hotcold.load(out, device="cpu", sparsity=0.0).logits(ids)
    reference = hotcold.load(dense, device="cpu").logits(ids)
    assert torch.allclose(full, reference, rtol=1e-4, atol=1e-4 * float(reference.abs().max()))
    return out


def hotcold_perplexity(model: Path, text: Path, *, ctx: int, chunks: int) -> float:
    """`hotcold perplexity --json` on `model` over `text` in its own process, as llama_perplexity runs llama.cpp's
    (context ctx, ctx * chunks tokens, 2 threads): its perplexity, after checking it scored `chunks` chunks."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "hotcold", "perplexity", "-m", str(model), "-f", str(text), "-c", str(ctx),
           "--max-tokens", str(ctx * chunks), "-t", "2", "--json"]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    result = json.loads(res.stdout)
    assert result["chunks"] == chunks
    return float(result["perplexity"])
