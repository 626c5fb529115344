"""SmallThinker (upstream llama.cpp's arch `smallthinker`; no transformers class exists): a tiny random Hugging
Face-layout checkpoint (`SmallThinkerForCausalLM`, the config keys upstream's converter reads), converted by
upstream's convert_hf_to_gguf.py (its vocabulary step the SentencePiece one, for the test tokenizer: SmallThinker's
reads a BPE tokenizer.json whose pre-tokenizer it must recognise, and Qwen's 151,936 tokens cost ~15 s a file open
on 2 cores; the vocabulary is not what these tests test), read by hotcold and compared with an independent float64 re-implementation of
upstream's graph written here from the checkpoint's tensors: the router on the raw residual before attn_norm, top-k
then the chosen sigmoids renormalised (or softmax), relu(gate) * up experts, NoPE on layers i % 4 == 0 when the
file has a sliding window, NeoX RoPE elsewhere, the dense output head.

Also: expert-row sparsity (only the live rows of the ReLU experts) equals the dense experts bit for bit; the
PowerInfer fork's files (ffn_down_exps transposed, `lm_head_profiler.weight`, no expert_gating_func key) read the
same; bad files are refused naming the key or tensor. Without the llama.cpp source the tests skip, saying so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import hotcold
from hotcold.gguf.io import GGUFError, ModelFile, TensorSpec, metadata_items, write_model_file
from tests.fixtures import TOKENIZER_VOCAB, random_ids, write_tokenizer
from tests.models.test_upstream_files import BIN, CONVERTER, SOURCE

pytestmark = pytest.mark.skipif(
    not CONVERTER.is_file(),
    reason=f"no llama.cpp source at {SOURCE} (HOTCOLD_LLAMA_CPP): upstream's converter is the only writer of "
    "SmallThinker files to compare with",
)
N_VOCAB, D, H, HKV, DH, F, E, K, L = TOKENIZER_VOCAB, 64, 4, 2, 16, 128, 4, 2, 5
EPS, THETA = 1e-6, 10000.0


def make_smallthinker(hf_dir: Path, spm_model: Path, *, seed: int = 0, softmax: bool = False) -> dict:
    """A SmallThinker checkpoint of random weights (5 layers: layers 0 and 4 global NoPE, the rest windowed) in
    hf_dir; returns its tensors (float32)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    t = {"model.embed_tokens.weight": rnd(N_VOCAB, D), "model.norm.weight": 1 + 0.3 * rnd(D)}
    for i in range(L):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = 1 + 0.3 * rnd(D)
        t[p + "post_attention_layernorm.weight"] = 1 + 0.3 * rnd(D)
        for name, rows in (("q", H * DH), ("k", HKV * DH), ("v", HKV * DH)):
            t[p + f"self_attn.{name}_proj.weight"] = rnd(rows, D, scale=0.5 / D**0.5 * 4)
        t[p + "self_attn.o_proj.weight"] = rnd(D, H * DH, scale=1 / (H * DH) ** 0.5)
        t[p + "block_sparse_moe.primary_router.weight"] = rnd(E, D, scale=0.5)
        for e in range(E):
            q = p + f"block_sparse_moe.experts.{e}."
            t[q + "gate.weight"] = (
                rnd(F, D, scale=1 / D**0.5) - 0.03
            )  # most gates negative, as SmallThinker's
            t[q + "up.weight"] = rnd(F, D, scale=1 / D**0.5)
            t[q + "down.weight"] = rnd(D, F, scale=2 / F**0.5)
    hf_dir.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in t.items()}, str(hf_dir / "model.safetensors"))
    config = dict(
        architectures=["SmallThinkerForCausalLM"], model_type="smallthinker", vocab_size=N_VOCAB, hidden_size=D,
        num_hidden_layers=L, num_attention_heads=H, num_key_value_heads=HKV, head_dim=DH, moe_ffn_hidden_size=F,
        moe_num_primary_experts=E, moe_num_active_primary_experts=K, moe_primary_router_apply_softmax=softmax,
        sliding_window_layout=[0, 1, 1, 1, 0], sliding_window_size=4096, rope_layout=[0, 1, 1, 1, 0],
        rope_theta=THETA, rms_norm_eps=EPS, max_position_embeddings=256, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, torch_dtype="float32",
    )  # fmt: skip
    (hf_dir / "config.json").write_text(json.dumps(config))
    write_tokenizer(hf_dir, spm_model)
    return t


def upstream_convert(hf_dir: Path, out: Path) -> Path:
    """hf_dir converted by upstream's converter in its own process, SmallThinker's vocabulary step swapped for the
    SentencePiece one (the rest, the keys and tensors under test, upstream's own)."""
    code = (
        "import runpy, sys\n"
        f"sys.path.insert(0, {str(SOURCE)!r})\n"
        f"sys.argv = ['convert_hf_to_gguf.py', {str(hf_dir)!r}, '--outfile', {str(out)!r}, '--outtype', 'f32']\n"
        f"main = runpy.run_path({str(CONVERTER)!r}, run_name='upstream')['main']\n"
        "from conversion.smallthinker import SmallThinkerModel\n"
        "SmallThinkerModel.set_vocab = lambda self: self._set_vocab_sentencepiece()\n"
        "main()\n"
    )
    env = dict(os.environ, PYTHONPATH=str(SOURCE / "gguf-py"), NO_LOCAL_GGUF="")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return out


def reference_logits(t: dict, ids: list[int], *, softmax: bool = False) -> torch.Tensor:
    """Upstream's smallthinker graph in float64, from the checkpoint's tensors: [len(ids), V]."""
    w = {k: v.double() for k, v in t.items()}
    T = len(ids)

    def rms(x, weight):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + EPS) * weight

    def rope(x):  # NeoX: dims j and j + Dh/2 rotate together, [T, heads, Dh]
        inv = THETA ** (-torch.arange(0, DH, 2, dtype=torch.float64) / DH)
        ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None]  # [T, Dh/2]
        cos, sin = ang.cos()[:, None], ang.sin()[:, None]
        a, b = x[..., : DH // 2], x[..., DH // 2 :]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)

    x = w["model.embed_tokens.weight"][ids]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for i in range(L):
        p = f"model.layers.{i}."
        router = x @ w[p + "block_sparse_moe.primary_router.weight"].T  # the raw residual, before attn_norm
        h = rms(x, w[p + "input_layernorm.weight"])
        q = (h @ w[p + "self_attn.q_proj.weight"].T).view(T, H, DH)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).view(T, HKV, DH)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).view(T, HKV, DH)
        if i % 4 != 0:  # NoPE on layers 0, 4 (the global ones); T < 4096: the window never cuts
            q, k = rope(q), rope(k)
        k, v = k.repeat_interleave(H // HKV, 1), v.repeat_interleave(H // HKV, 1)
        scores = torch.einsum("thd,shd->hts", q, k) / DH**0.5
        probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1)
        attn = torch.einsum("hts,shd->thd", probs, v).reshape(T, H * DH)
        x = x + attn @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        top, chosen = router.topk(K, -1)
        # upstream's norm_w: the sum clamped below at 2^-14 (a token whose chosen sigmoids are all tiny keeps them)
        sig = torch.sigmoid(top)
        weights = torch.softmax(top, -1) if softmax else sig / sig.sum(-1, keepdim=True).clamp(min=2**-14)
        out = torch.zeros_like(x)
        for r in range(T):
            for j in range(K):
                q_ = p + f"block_sparse_moe.experts.{int(chosen[r, j])}."
                a = torch.relu(w[q_ + "gate.weight"] @ h[r]) * (w[q_ + "up.weight"] @ h[r])
                out[r] += weights[r, j] * (w[q_ + "down.weight"] @ a)
        x = x + out
    return rms(x, w["model.norm.weight"]) @ w["model.embed_tokens.weight"].T


@pytest.fixture(scope="module")
def upstream(tmp_path_factory, spm_model_file):
    folder = tmp_path_factory.mktemp("smallthinker")
    tensors = make_smallthinker(folder / "hf", spm_model_file)
    return tensors, upstream_convert(folder / "hf", folder / "upstream.gguf")


def rewrite(path: Path, out: Path, *, drop=(), meta: dict | None = None, change=None, add=()) -> Path:
    """path's keys and tensors written to out: without the tensors `drop`, the keys in `meta` changed (None: left
    out), change(name, array) -> array (or None: as it is) for each tensor's values, `add` (name, array) more."""
    src, meta = ModelFile(path), meta or {}
    items = [(k, meta.get(k, v), *rest) for k, v, *rest in metadata_items(src) if meta.get(k, v) is not None]
    specs = []
    for name, e in src.tensors.items():
        if name in drop:
            continue
        data = np.asarray(e.data)
        new = change(name, data) if change is not None else None
        if new is None:
            specs.append(TensorSpec(name, tuple(e.shape), e.qtype, lambda d=data: d))
        else:
            qtype = (
                gguf.GGMLQuantizationType.F16 if new.dtype == np.float16 else gguf.GGMLQuantizationType.F32
            )
            specs.append(TensorSpec(name, new.shape, qtype, lambda d=new: d))
    for name, data in add:
        specs.append(TensorSpec(name, data.shape, gguf.GGMLQuantizationType.F32, lambda d=data: d))
    return write_model_file(out, src.architecture, items, specs)


def test_upstream_file_matches_a_float64_reimplementation(upstream):
    tensors, path = upstream
    mf = ModelFile(path)
    assert mf.architecture == "smallthinker"
    assert mf.metadata["smallthinker.expert_gating_func"] == 2  # sigmoid
    assert mf.metadata["smallthinker.attention.sliding_window"] == 4096
    assert tuple(mf.tensors["blk.0.ffn_down_exps.weight"].shape) == (E, D, F)
    llm = hotcold.load(path, device="cpu")
    ids = random_ids(24, seed=4)
    ours, ref = llm.logits(ids), reference_logits(tensors, ids).float()
    assert ref.abs().max() > 1.0, "test model too tame to be a meaningful comparison"
    assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max(), float((ours - ref).abs().max())
    for i in range(L):  # every expert gets tokens
        assert len(torch.unique(llm.engine.seq.routing[i])) == E
    assert llm.decoder == "eager"  # float32 weights: torch multiplies them (the F16 file's decoder: below)
    specs = [
        layer.spec for layer in llm.loaded.model.layers
    ]  # upstream's pattern: i % 4 == 0 global and NoPE
    assert [(s.nope, s.sliding_window) for s in specs] == [
        (i % 4 == 0, 0 if i % 4 == 0 else 4096) for i in range(L)
    ]


def test_layer_pattern_as_upstream_derives_it():
    """A pattern key (a period, or a flag per layer) overrides which layers are windowed; NoPE stays i % 4 == 0;
    without a window every layer is global with RoPE."""
    from types import SimpleNamespace

    from hotcold.models.smallthinker import layer_pattern

    def pattern(window, **meta):
        config = SimpleNamespace(n_layer=6, arch="smallthinker", sliding_window=window)
        return layer_pattern(
            SimpleNamespace(config=config, file=SimpleNamespace(metadata=meta), path="m.gguf")
        )

    assert pattern(None) == [(False, False)] * 6
    assert pattern(8) == [(i % 4 != 0, i % 4 == 0) for i in range(6)]
    assert pattern(8, **{"smallthinker.attention.sliding_window_pattern": 2}) == [
        (i % 2 != 0, i % 4 == 0) for i in range(6)
    ]
    flags = [True, False, True, True, False, False]
    assert pattern(8, **{"smallthinker.attention.sliding_window_pattern": flags}) == [
        (f, i % 4 == 0) for i, f in enumerate(flags)
    ]


def test_softmax_gating_and_each_feature_matter(upstream, tmp_path):
    """expert_gating_func 1 routes with the softmax (the reference follows); the sigmoid default differs from it,
    and so does RoPE on the NoPE layers: the test would see either mistake."""
    tensors, path = upstream
    soft = rewrite(path, tmp_path / "softmax.gguf", meta={"smallthinker.expert_gating_func": 1})
    ids = random_ids(16, seed=5)
    ours = hotcold.load(soft, device="cpu").logits(ids)
    ref = reference_logits(tensors, ids, softmax=True).float()
    assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max()
    sigmoid = reference_logits(tensors, ids).float()
    assert (sigmoid - ref).abs().max() > 1e-2 * ref.abs().max()
    # without the window key upstream ropes every layer: different logits, as the file no longer says NoPE
    every = hotcold.load(rewrite(path, tmp_path / "rope.gguf", meta={"smallthinker.attention.sliding_window": None}),
                         device="cpu").logits(ids)  # fmt: skip
    assert (every - sigmoid).abs().max() > 1e-2 * ref.abs().max()


@pytest.fixture(scope="module")
def half(upstream, tmp_path_factory) -> Path:
    """Upstream's file with its matrices in F16 (the row kernels read them; float32 goes to torch)."""

    def f16(name, data):
        return data.astype(np.float16) if data.ndim >= 2 and "token_embd" not in name else None

    return rewrite(upstream[1], tmp_path_factory.mktemp("f16") / "f16.gguf", change=f16)


def test_expert_rows_equal_the_dense_experts_bit_for_bit(half):
    """F16 experts: the live rows only (relu(gate) != 0) equal every row, bit for bit, in prefill and in decode;
    the timings count the rows computed, well under all of them."""
    llm = hotcold.load(half, device="cpu")
    ids = random_ids(12, seed=6)
    engine = llm.engine
    sparse, dense = engine.logits(ids), engine.logits(ids, dense=True)
    assert torch.equal(sparse, dense)

    def decode(dense: bool) -> torch.Tensor:  # a 4-token prompt, then one token a step
        engine.truncate(0)
        engine.seq.dense = dense
        out = [engine.prefill(ids[:4])] + [
            engine.forward([ids[p]], p, last_only=True)[-1] for p in range(4, 12)
        ]
        engine.seq.dense = False
        return torch.stack(out)

    assert torch.equal(decode(False), decode(True))
    llm.generate("Hello world", max_tokens=4, ignore_eos=True)
    stats = llm.last_stats  # what `timings` and the server's figures report
    assert 0 < stats.neurons_computed < 0.75 * stats.neurons_total, (
        stats.neurons_computed,
        stats.neurons_total,
    )


def test_fork_files_read_the_same(upstream, tmp_path):
    """PowerInfer's fork: ffn_down_exps transposed ([E, F, D]), an lm_head_profiler.weight, no gating key (sigmoid,
    said in the load notes): the same logits."""
    _, path = upstream

    def transpose(name, data):
        return (
            np.ascontiguousarray(data.transpose(0, 2, 1)) if name.endswith("ffn_down_exps.weight") else None
        )

    fork = rewrite(path, tmp_path / "fork.gguf", change=transpose, meta={"smallthinker.expert_gating_func": None},
                   add=[("lm_head_profiler.weight", np.ones((8, D), np.float32))])  # fmt: skip
    assert tuple(ModelFile(fork).tensors["blk.0.ffn_down_exps.weight"].shape) == (E, F, D)
    ids = random_ids(16, seed=7)
    theirs, ours = hotcold.load(path, device="cpu"), hotcold.load(fork, device="cpu")
    notes = " ".join(ours.loaded.notes)
    assert "expert_gating_func absent: sigmoid" in notes and "lm_head_profiler.weight" in notes
    a, b = theirs.logits(ids), ours.logits(ids)
    assert (a - b).abs().max() <= 1e-5 * a.abs().max()


def test_hotcold_convert_writes_what_upstream_writes(upstream, tmp_path):
    """The same checkpoint through `hotcold convert`: the same tensors (names, shapes, F32 values) and smallthinker.*
    keys as upstream's converter."""
    from hotcold.convert import convert

    _, path = upstream
    theirs = ModelFile(path)
    ours = ModelFile(convert(Path(path).parent / "hf", None, tmp_path / "ours.gguf", outtype="f32"))
    assert sorted(ours.tensors) == sorted(theirs.tensors)
    for name in ours.tensors:
        a, b = ours.tensor(name).float(), theirs.tensor(name).float()
        assert a.shape == b.shape and bool((a == b).all()), name
    keys = sorted(k for k in theirs.metadata if k.startswith("smallthinker."))
    assert {k: ours.metadata.get(k) for k in keys} == {k: theirs.metadata[k] for k in keys}


@pytest.mark.parametrize(
    "drop, meta, message",
    [
        (("blk.2.ffn_up_exps.weight",), None, "missing tensor blk.2.ffn_up_exps.weight"),
        (
            (),
            {"smallthinker.expert_count": 5},
            r"blk.0.ffn_gate_exps.weight has shape \(4, 128, 64\), but "
            "smallthinker.expert_count is 5",
        ),  # fmt: skip
        ((), {"smallthinker.expert_gating_func": 3}, "smallthinker.expert_gating_func is 3"),
        ((), {"smallthinker.expert_used_count": 0}, "expert_used_count 0: need 1 <= used <= count"),
    ],
)
def test_bad_files_are_refused_by_name(upstream, tmp_path, drop, meta, message):
    _, path = upstream
    bad = rewrite(path, tmp_path / "bad.gguf", drop=drop, meta=meta)
    with pytest.raises((GGUFError, ValueError), match=message):
        hotcold.load(bad, device="cpu")


@pytest.mark.skipif(
    not (BIN / "llama-quantize").is_file() or not (BIN / "llama-perplexity").is_file(),
    reason=f"no llama.cpp build (llama-quantize, llama-perplexity) at {BIN}",
)
def test_q8_0_perplexity_matches_llama_perplexity(upstream, tmp_path):
    """Upstream's file quantized by `llama-quantize ... Q8_0` (the experts then run over their live rows in the C
    row kernels): hotcold's perplexity within 0.5% of `llama-perplexity`'s, context 128, 4 chunks."""
    from hotcold.cli.perplexity import perplexity
    from hotcold.placement.profile import corpus_tokens
    from tests.fixtures import llama_perplexity, training_text

    _, path = upstream
    # logits a tenth as large (the output norm scaled): a perplexity in the hundreds, not 1e10
    tame = rewrite(
        path, tmp_path / "tame.gguf", change=lambda n, d: d * 0.1 if n == "output_norm.weight" else None
    )
    q8 = tmp_path / "q8_0.gguf"
    res = subprocess.run(
        [str(BIN / "llama-quantize"), str(tame), str(q8), "Q8_0"], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr[-2000:]
    text = tmp_path / "text.txt"
    text.write_text(training_text())
    ctx, chunks = 128, 4
    theirs = llama_perplexity(BIN / "llama-perplexity", q8, text, ctx=ctx, chunks=chunks)
    llm = hotcold.load(q8, device="cpu", ctx_size=ctx)
    ids = corpus_tokens(llm.tokenizer, text.read_text(), max_tokens=ctx * chunks, source=text)
    ours = perplexity(llm, ids, ctx=ctx)
    assert ours["chunks"] == chunks
    print(f"smallthinker Q8_0: hotcold {ours['perplexity']:.4f}, llama-perplexity {theirs:.4f}")
    assert abs(ours["perplexity"] / theirs - 1) <= 0.005, (ours["perplexity"], theirs)
    assert llm.engine.seq.neuron_totals()[0] < 0.75 * llm.engine.seq.neuron_totals()[1]  # rows were skipped


def test_cached_split_and_batched_decode_equal_one_forward(half):
    """The family runner's equivalences on the F16 file (experts over their live rows): cached decode == one full
    forward, a generation split in two == one go, a batch of sequences == each alone."""
    from tests.fixtures import check_cache_split_batch

    llm = hotcold.load(half, device="cpu")
    check_cache_split_batch(llm, random_ids(24, seed=2)[:5], tokens=12, atol=1e-4, rtol=0)


def test_one_call_decoder_equals_the_eager_one(half):
    """The F16 file decodes in one C call a token (the router on the layer input before attention, sigmoid gating,
    NoPE layers, ReLU experts over their live rows: relu_rows_ffn), with the eager decoder's logits, greedy tokens
    (alone and batched) and computed-row counts."""
    from tests.fixtures import check_decoder_equals_eager, decode_logits

    fast = hotcold.load(half, device="cpu")
    assert fast.decoder == "cpu_one_call", fast.loaded.notes
    eager = hotcold.load(half, device="cpu", decoder="eager")
    check_decoder_equals_eager(fast, eager)
    ids = random_ids(12, seed=5)
    counts = []
    for llm in (fast, eager):
        llm.engine.seq.counts = [type(c)() for c in llm.engine.seq.counts]
        decode_logits(llm, ids, 6)
        counts.append(llm.engine.seq.neuron_totals())
    assert counts[0] == counts[1] and counts[0][0] < 0.75 * counts[0][1], (
        counts
    )  # the same live rows, skipped
