"""gpt-oss against Hugging Face transformers' GptOssForCausalLM: a tiny random model (attention sinks, a sliding
window of 8 on even layers, YaRN RoPE, q/k/v/o biases, a router with a bias, clamped-SwiGLU experts with biases,
interleaved gate/up in the checkpoint), converted by `hotcold convert` as upstream llama.cpp's converter writes arch
`gpt-oss`, and by upstream's converter itself (skips without the llama.cpp source); its experts also in MXFP4 (ggml
type 39), as upstream's converter writes OpenAI's checkpoints.

transformers' gpt-oss config says YaRN `truncate: false`; llama.cpp always floors / ceils YaRN's correction dims
(transformers' truncate: true), so the reference model here is built with truncate true: the math hotcold and
llama.cpp run. (On the published checkpoints the two differ slightly in a few RoPE pairs.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import hotcold
from hotcold.convert import convert
from hotcold.convert.checkpoint import ConvertError
from hotcold.gguf.io import ModelFile, TensorSpec, metadata_items, write_model_file
from hotcold.gguf.quants import QuantTensor
from hotcold.kernels import cpu
from tests.fixtures import (
    TOKENIZER_VOCAB,
    hf_logits,
    random_ids,
    run_family_checks,
    save_checkpoint,
    scale_matrices,
)
from tests.models.test_upstream_files import BIN, CONVERTER, upstream_convert
from tests.models.test_upstream_qwen import VOCAB, qwen_tokenizer  # noqa: F401 (a fixture: Qwen's BPE tokenizer)

N_EXPERT, WINDOW = 4, 8


def exact_logits(path: Path, ids: list[int]) -> torch.Tensor:
    """A file's logits with the torch kernels: MXFP4 dequantized exactly, float activations. The C kernels read
    MXFP4 blocks in place and, as ggml's MXFP4 dot product does, multiply them by the activations quantized to
    8 bits per 32 values: tests/kernels/test_cpu.py bounds that rounding per product, and on a whole model it can
    flip a router's top-k choice (a jump, not a drift), so the C path's model-level reference is llama.cpp's
    perplexity on the same file (test_llama_quantize_mxfp4_moe_perplexity_matches_llama_perplexity)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("HOTCOLD_NO_CEXT", "1")
    cpu._reset_for_tests()
    try:
        return hotcold.load(path, device="cpu").logits(ids)
    finally:
        mp.undo()
        cpu._reset_for_tests()


def make_gpt_oss(hf_dir: Path, tokenizer, *, seed: int = 0, mxfp4_values: bool = False, head_scale: float = 1.0,
                 **overrides):  # fmt: skip
    """tokenizer: the test SPM model (a Path to its file), or a folder of tokenizer files to copy (upstream's
    converter reads a BPE tokenizer.json). mxfp4_values: expert matrices rounded to MXFP4 values (exact in MXFP4).
    head_scale: the output head times it (logits far from uniform over a large vocabulary)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    settings = dict(
        vocab_size=TOKENIZER_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_local_experts=N_EXPERT, num_experts_per_tok=2, sliding_window=WINDOW,
        max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
                             truncate=True, original_max_position_embeddings=64),
    )  # fmt: skip
    settings.update(overrides)
    torch.manual_seed(seed)
    hf = GptOssForCausalLM(GptOssConfig(**settings)).eval()
    scale_matrices(hf)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("bias", "sinks")):  # biases and sinks that matter, not drowning the embeddings
                p.copy_(torch.randn_like(p) * (0.02 if "self_attn" in name and "bias" in name else 0.5))
            if name.endswith("mlp.router.weight"):  # a router that spreads tokens over every expert
                p.copy_(torch.randn_like(p))
            if "experts" in name and not name.endswith("bias"):
                p.mul_(16.0)  # gate / up past the clamp's limit (7) for some tokens
                if mxfp4_values:
                    p.copy_(mxfp4_round(p.transpose(-1, -2)).transpose(-1, -2))
        hf.lm_head.weight.mul_(head_scale)
    if isinstance(tokenizer, Path) and tokenizer.is_file():
        save_checkpoint(hf, hf_dir, tokenizer)
    else:
        hf.save_pretrained(hf_dir, safe_serialization=True)
        for f in Path(tokenizer).iterdir():
            shutil.copy(f, hf_dir / f.name)
    return hf


def mxfp4_round(x: torch.Tensor) -> torch.Tensor:
    """x [..., cols] rounded to MXFP4 values along its rows (blocks of 32 columns), as gguf-py quantizes them."""
    q = gguf.quants.quantize(x.detach().float().numpy(), gguf.GGMLQuantizationType.MXFP4)
    return torch.from_numpy(gguf.quants.dequantize(q, gguf.GGMLQuantizationType.MXFP4)).reshape(x.shape)


@pytest.fixture(scope="module")
def converted(tmp_path_factory, spm_model_file):
    folder = tmp_path_factory.mktemp("gpt_oss")
    hf = make_gpt_oss(folder / "hf", spm_model_file)
    return hf, convert(folder / "hf", None, folder / "model.gguf", outtype="f32")


def test_file_layout_follows_upstream(converted):
    hf, path = converted
    mf = ModelFile(path)
    meta = mf.metadata
    assert mf.architecture == "gpt-oss"
    assert meta["gpt-oss.expert_count"] == N_EXPERT and meta["gpt-oss.expert_feed_forward_length"] == 96
    assert meta["gpt-oss.attention.sliding_window"] == WINDOW and meta["gpt-oss.attention.key_length"] == 32
    assert (
        meta["gpt-oss.rope.scaling.type"] == "yarn"
        and meta["gpt-oss.rope.scaling.original_context_length"] == 64
    )
    assert "gpt-oss.rope.dimension_count" not in meta  # as upstream: the head size rotates whole
    assert tuple(mf.tensors["blk.0.ffn_gate_exps.weight"].shape) == (N_EXPERT, 96, 64)
    assert tuple(mf.tensors["blk.0.ffn_down_exps.weight"].shape) == (N_EXPERT, 64, 96)
    assert tuple(mf.tensors["blk.0.ffn_up_exps.bias"].shape) == (N_EXPERT, 96)
    assert tuple(mf.tensors["blk.0.attn_sinks.weight"].shape) == (4,)
    assert {"blk.1.post_attention_norm.weight", "blk.1.attn_output.bias", "blk.1.ffn_gate_inp.bias"} <= set(
        mf.tensors
    )
    experts = hf.model.layers[1].mlp.experts  # gate_up [E, D, 2F]: gate the even columns, up the odd
    assert torch.equal(
        mf.tensor("blk.1.ffn_gate_exps.weight")[2], experts.gate_up_proj[2][:, 0::2].T.detach()
    )
    assert torch.equal(mf.tensor("blk.1.ffn_up_exps.weight")[2], experts.gate_up_proj[2][:, 1::2].T.detach())
    assert torch.equal(mf.tensor("blk.1.ffn_up_exps.bias")[2], experts.gate_up_proj_bias[2][1::2].detach())


def test_logits_match_transformers(converted):
    """40 tokens: past the window of 8 (layer 0 attends in it, layer 1 globally), sinks nonzero, every expert routed,
    logits within 1e-4 of the logit scale."""
    hf, path = converted
    llm = hotcold.load(path, device="cpu")
    model = llm.loaded.model
    assert [layer.spec.sliding_window for layer in model.layers] == [WINDOW, 0]
    assert all(layer.spec.sinks and layer.sinks.abs().min() > 0 for layer in model.layers)
    ids = random_ids(40)
    ours, ref = llm.logits(ids), hf_logits(hf, ids)
    scale = ref.abs().max()
    assert scale > 1.0, "test model too tame to be a meaningful comparison"
    assert (ours - ref).abs().max() <= 1e-4 * scale, float((ours - ref).abs().max() / scale)
    for i in range(len(hf.model.layers)):  # every expert gets tokens: the test exercises them all
        assert len(torch.unique(llm.engine.seq.routing[i])) == N_EXPERT


def test_window_sinks_and_clamp_each_matter(converted):
    """The reference exercises what it claims: without the window, the sinks or the clamp the logits move."""
    from hotcold.sparse import ffn_weights

    hf, path = converted
    ids = random_ids(40)
    ref = hotcold.load(path, device="cpu").logits(ids)
    scale = ref.abs().max()
    llm = hotcold.load(path, device="cpu")
    layer0 = llm.loaded.model.layers[0]
    object.__setattr__(layer0, "spec", type(layer0.spec)(**{**layer0.spec.__dict__, "sliding_window": 0}))
    assert (llm.logits(ids) - ref).abs().max() > 1e-2 * scale
    llm = hotcold.load(path, device="cpu")
    for layer in llm.loaded.model.layers:
        object.__setattr__(layer, "sinks", torch.full_like(layer.sinks, -1e4))
    assert (llm.logits(ids) - ref).abs().max() > 1e-2 * scale
    limit, fused = ffn_weights.SWIGLU_OAI_LIMIT, ffn_weights.ffn_calls.ffn_combine
    try:  # torch's clamped SwiGLU without its limit (the C combine's limit is a constant)
        ffn_weights.SWIGLU_OAI_LIMIT = 1e9
        ffn_weights.ffn_calls.ffn_combine = lambda kind, *a: None if kind == "swiglu_oai" else fused(kind, *a)
        assert (hotcold.load(path, device="cpu").logits(ids) - ref).abs().max() > 1e-3 * scale
    finally:
        ffn_weights.SWIGLU_OAI_LIMIT, ffn_weights.ffn_calls.ffn_combine = limit, fused


def test_family_runner(converted):
    """Cached decode == full forward (past the window), split generation == one go, batch == alone; the one-call
    decoder (sinks in the C attention, the router's and experts' biases and the clamped SwiGLU in the C MoE tail)
    equal to the eager one on the F16 copy."""
    hf, path = converted
    run_family_checks(path, hf, greedy=False)


def to_openai_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, R, C] of MXFP4 values (along C) in OpenAI's checkpoint form, written out here from ggml's blocks:
    blocks [E, R, C / 32, 16] uint8 (byte k: elements 2k low, 2k + 1 high), scales [E, R, C / 32] uint8 (E8M0)."""
    raw = gguf.quants.quantize(w.detach().float().numpy(), gguf.GGMLQuantizationType.MXFP4)
    raw = raw.reshape(*w.shape[:2], -1, 17)
    qs = raw[..., 1:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # ggml: byte j holds elements j and j + 16
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return torch.from_numpy(np.ascontiguousarray(blocks)), torch.from_numpy(np.ascontiguousarray(raw[..., 0]))


def openai_checkpoint(hf, hf_dir: Path) -> None:
    """Rewrite a saved checkpoint (experts of MXFP4 values) as OpenAI publishes gpt-oss: experts.*_proj_blocks /
    _scales and a quantization_config; transformers' own MXFP4 decoder gives the float experts back."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    state = load_file(hf_dir / "model.safetensors")
    for i in range(len(hf.model.layers)):
        stem = f"model.layers.{i}.mlp.experts."
        for proj in ("gate_up_proj", "down_proj"):
            w = state.pop(stem + proj)  # transformers' [E, in, out]; OpenAI's rows are the outputs
            blocks, scales = to_openai_mxfp4(w.transpose(1, 2))
            assert torch.equal(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32), w)
            state[stem + proj + "_blocks"], state[stem + proj + "_scales"] = blocks, scales
    save_file(state, hf_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((hf_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                     "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}  # fmt: skip
    (hf_dir / "config.json").write_text(json.dumps(config))


def test_openai_mxfp4_checkpoint_converts_to_mxfp4(tmp_path, spm_model_file):
    """`hotcold convert` of a checkpoint as OpenAI publishes it: the experts stay MXFP4 (ggml type 39) whatever
    --outtype says, their values those of the float model's experts, and the logits match transformers'."""
    hf = make_gpt_oss(tmp_path / "hf", spm_model_file, seed=7, mxfp4_values=True)
    float_file = ModelFile(convert(tmp_path / "hf", None, tmp_path / "float.gguf", outtype="f32"))
    openai_checkpoint(hf, tmp_path / "hf")
    mf = ModelFile(convert(tmp_path / "hf", None, tmp_path / "mxfp4.gguf", outtype="f32"))
    for name in ("blk.0.ffn_gate_exps.weight", "blk.1.ffn_up_exps.weight", "blk.1.ffn_down_exps.weight"):
        assert mf.tensors[name].qtype == gguf.GGMLQuantizationType.MXFP4
        assert torch.equal(
            mf.tensor(name).dequantize().reshape(float_file.tensors[name].shape), float_file.tensor(name)
        )
    assert sorted(mf.tensors) == sorted(float_file.tensors)
    ids = random_ids(40, seed=8)
    ours, ref = exact_logits(mf.path, ids), hf_logits(hf, ids)
    assert ref.abs().max() > 1.0
    assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_mxfp4_experts_match_transformers(tmp_path, spm_model_file):
    """The experts in MXFP4 (ggml type 39) as upstream's converter writes OpenAI's checkpoints: the reference's
    expert weights are MXFP4 values, so the file holds them exactly and hotcold's exact kernels match transformers
    within 1e-4 (exact_logits: what the C kernels' activation rounding does instead)."""
    hf = make_gpt_oss(tmp_path / "hf", spm_model_file, seed=3, mxfp4_values=True)
    f32 = ModelFile(convert(tmp_path / "hf", None, tmp_path / "f32.gguf", outtype="f32"))
    mx = gguf.GGMLQuantizationType.MXFP4
    specs = []
    for name, entry in f32.tensors.items():
        values = f32.tensor(name).float().numpy()
        if name.endswith("_exps.weight"):
            raw = gguf.quants.quantize(values, mx)
            assert np.array_equal(gguf.quants.dequantize(raw, mx).reshape(values.shape), values)
            specs.append(TensorSpec(name, tuple(entry.shape), mx, lambda raw=raw: raw))
        else:
            specs.append(TensorSpec(name, tuple(entry.shape), entry.qtype, lambda v=values: v))
    path = write_model_file(tmp_path / "mxfp4.gguf", "gpt-oss", metadata_items(f32), specs)
    assert ModelFile(path).tensors["blk.0.ffn_down_exps.weight"].qtype == mx
    assert isinstance(
        hotcold.load(path, device="cpu").loaded.model.layers[0].ffn.experts[0].weights.up, QuantTensor
    )
    ids = random_ids(40, seed=4)
    ours, ref = exact_logits(path, ids), hf_logits(hf, ids)
    assert ref.abs().max() > 1.0
    assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max()


def rewrite(src: ModelFile, out: Path, *, drop: str | None = None, meta: dict | None = None) -> Path:
    """src's tensors and keys written to out, without tensor `drop`, with the keys in `meta` changed (None: left
    out)."""
    meta = meta or {}
    items = [
        (k, meta.get(k, v), *rest)
        for k, v, *rest in metadata_items(src)
        if k not in meta or meta[k] is not None
    ]
    specs = [
        TensorSpec(name, tuple(e.shape), e.qtype, lambda e=e: np.asarray(e.data))
        for name, e in src.tensors.items()
        if name != drop
    ]
    return write_model_file(out, src.architecture, items, specs)


@pytest.mark.parametrize(
    "drop, meta, message",
    [
        ("blk.1.ffn_gate_exps.bias", None, "missing tensor blk.1.ffn_gate_exps.bias"),
        ("blk.0.attn_output.bias", None, "missing tensor blk.0.attn_output.bias"),  # required, as upstream
        ("blk.1.attn_sinks.weight", None, "missing tensor blk.1.attn_sinks.weight"),
        (
            None,
            {"gpt-oss.expert_count": 5},
            r"blk.0.ffn_up_exps.bias has shape \(4, 96\), expected \(5, 96\)",
        ),
        (None, {"gpt-oss.expert_used_count": 0}, "expert_used_count 0: need 1 <= used <= count"),
        (
            None,
            {"gpt-oss.attention.sliding_window": None},
            "missing metadata key gpt-oss.attention.sliding_window",
        ),
    ],
)
def test_bad_files_are_refused_by_name(converted, tmp_path, drop, meta, message):
    from hotcold.gguf.io import GGUFError

    _, path = converted
    bad = rewrite(ModelFile(path), tmp_path / "bad.gguf", drop=drop, meta=meta)
    with pytest.raises((GGUFError, ValueError), match=message):
        hotcold.load(bad, device="cpu")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
        ({"num_experts_per_tok": 9}, "need 1 <= per_tok <= experts"),
        ({"swiglu_limit": 5.0}, "swiglu_limit"),
    ],
)
def test_unsupported_checkpoints_are_refused_by_name(converted, tmp_path, change, message):
    _, path = converted
    shutil.copytree(Path(path).parent / "hf", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ConvertError, match=message):
        convert(tmp_path / "hf", None, tmp_path / "m.gguf", outtype="f32")


@pytest.mark.skipif(
    not CONVERTER.is_file() or not VOCAB.is_file(),
    reason=f"no llama.cpp source with {VOCAB.name} at {CONVERTER.parent} (HOTCOLD_LLAMA_CPP)",
)
@pytest.mark.parametrize("openai_mxfp4", [False, True])
def test_upstream_converter_file(tmp_path, qwen_tokenizer, openai_mxfp4):  # noqa: F811
    """The same kind of checkpoint (with Qwen's BPE vocabulary, which upstream's converter recognises), float or with
    its experts in OpenAI's MXFP4, converted by upstream's convert_hf_to_gguf.py: hotcold reads that file and matches
    transformers' logits, and `hotcold convert` writes the same tensors (bit for bit: the MXFP4 blocks byte for
    byte) and the same gpt-oss.* and tokenizer keys."""
    hf = make_gpt_oss(tmp_path / "hf", qwen_tokenizer, seed=5, vocab_size=151936, bos_token_id=151643,
                      eos_token_id=151643, mxfp4_values=openai_mxfp4)  # fmt: skip
    if openai_mxfp4:
        openai_checkpoint(hf, tmp_path / "hf")
    theirs = ModelFile(upstream_convert(tmp_path / "hf", tmp_path / "upstream.gguf"))
    assert theirs.architecture == "gpt-oss"
    ids = random_ids(40, seed=6)
    ours = (
        exact_logits(theirs.path, ids)
        if openai_mxfp4
        else hotcold.load(theirs.path, device="cpu").logits(ids)
    )
    ref = hf_logits(hf, ids)
    assert ref.abs().max() > 1.0
    assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max()

    mine = ModelFile(convert(tmp_path / "hf", None, tmp_path / "ours.gguf", outtype="f32"))
    assert sorted(mine.tensors) == sorted(theirs.tensors)
    for name in mine.tensors:
        a, b = (
            t.dequantize() if isinstance(t, QuantTensor) else t.float()
            for t in (mine.tensor(name), theirs.tensor(name))
        )
        assert a.shape == b.shape and bool((a == b).all()), name
        assert mine.tensors[name].qtype == theirs.tensors[name].qtype, name
        if openai_mxfp4 and name.endswith("_exps.weight"):
            assert mine.tensors[name].qtype == gguf.GGMLQuantizationType.MXFP4
            assert np.array_equal(mine.tensors[name].data, theirs.tensors[name].data), name
    keys = {k for k in theirs.metadata if k.startswith(("gpt-oss.", "tokenizer.ggml."))}
    assert {k: mine.metadata.get(k) for k in sorted(keys)} == {k: theirs.metadata[k] for k in sorted(keys)}


@pytest.mark.skipif(
    not CONVERTER.is_file() or not VOCAB.is_file() or not (BIN / "llama-quantize").is_file()
    or not (BIN / "llama-perplexity").is_file(),
    reason=f"no llama.cpp source and build (llama-quantize, llama-perplexity) at {CONVERTER.parent}",
)  # fmt: skip
def test_llama_quantize_mxfp4_moe_perplexity_matches_llama_perplexity(tmp_path, qwen_tokenizer):  # noqa: F811
    """Upstream's converter, then `llama-quantize ... MXFP4_MOE` (experts MXFP4 by ggml's own quantizer, attention
    and output Q8_0): hotcold's perplexity on that file within 0.5% of `llama-perplexity`'s, context 128 (past
    the window of 8), 4 chunks."""
    import subprocess

    from tests.fixtures import hotcold_perplexity, llama_perplexity, training_text

    make_gpt_oss(tmp_path / "hf", qwen_tokenizer, seed=9, vocab_size=151936, bos_token_id=151643,
                 eos_token_id=151643, head_scale=5.0)  # fmt: skip
    f32 = upstream_convert(tmp_path / "hf", tmp_path / "f32.gguf")
    mxfp4 = tmp_path / "mxfp4.gguf"
    res = subprocess.run([str(BIN / "llama-quantize"), str(f32), str(mxfp4), "MXFP4_MOE"], capture_output=True,
                         text=True)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    types = {e.qtype.name for e in ModelFile(mxfp4).tensors.values()}
    assert {"MXFP4", "Q8_0"} <= types, types
    text = tmp_path / "text.txt"
    text.write_text(training_text())
    ctx, chunks = 128, 4
    theirs = llama_perplexity(BIN / "llama-perplexity", mxfp4, text, ctx=ctx, chunks=chunks)
    ours = hotcold_perplexity(mxfp4, text, ctx=ctx, chunks=chunks)
    print(f"gpt-oss MXFP4_MOE: hotcold {ours:.4f}, llama-perplexity {theirs:.4f}")
    assert abs(ours / theirs - 1) <= 0.005, (ours, theirs)


def test_quantize_mxfp4_moe_writes_what_llama_quantize_writes(converted, tmp_path):
    """`hotcold quantize IN OUT mxfp4_moe`: the stacked experts MXFP4, every other matrix Q8_0 (router, norms,
    biases and sinks as they are), general.file_type 38; with llama-quantize at hand, its MXFP4_MOE file byte for
    byte. The result loads (its logits: test_llama_quantize_mxfp4_moe_perplexity_matches_llama_perplexity)."""
    import subprocess

    from hotcold.convert.quantize import quantize_file

    _, path = converted
    ours = ModelFile(quantize_file(path, tmp_path / "ours.gguf", "mxfp4_moe"))
    types = {name: e.qtype.name for name, e in ours.tensors.items()}
    assert types["blk.0.ffn_gate_exps.weight"] == types["blk.1.ffn_down_exps.weight"] == "MXFP4"
    assert types["blk.0.attn_q.weight"] == types["output.weight"] == types["token_embd.weight"] == "Q8_0"
    assert types["blk.0.ffn_gate_inp.weight"] == types["blk.0.ffn_up_exps.bias"] == "F32"
    assert ours.metadata["general.file_type"] == 38
    assert torch.isfinite(hotcold.load(ours.path, device="cpu").logits(random_ids(24, seed=11))).all()
    if not (BIN / "llama-quantize").is_file():
        pytest.skip(f"no llama-quantize in {BIN} to compare bytes with")
    theirs = tmp_path / "theirs.gguf"
    res = subprocess.run([str(BIN / "llama-quantize"), str(path), str(theirs), "MXFP4_MOE"], capture_output=True,
                         text=True)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    theirs = ModelFile(theirs)
    assert sorted(theirs.tensors) == sorted(ours.tensors)
    for name, entry in ours.tensors.items():
        assert entry.qtype == theirs.tensors[name].qtype, name
        assert np.array_equal(np.asarray(entry.data), np.asarray(theirs.tensors[name].data)), name


def test_o200k_pre_tokenizer_is_written_as_gpt_4o(tmp_path):
    """gpt-oss's o200k split (tokenizer.json: Split with its regex, then ByteLevel) is `tokenizer.ggml.pre`
    "gpt-4o", as upstream's converter names it, and hotcold's tokenizer splits such a file as tokenizers does
    (the merge b+A crosses the gpt-4o split of "abAB" into "ab" and "AB", not the default split's one word)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    from hotcold.tokenizer.bpe import GPT4O_REGEX
    from hotcold.tokenizer.vocab import Tokenizer as HotcoldTokenizer

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["bA"] = len(vocab)
    vocab["ab"] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[("b", "A"), ("a", "b")]))
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(GPT4O_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tk.decoder = decoders.ByteLevel()
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    tk.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    make_gpt_oss(tmp_path / "hf", folder, vocab_size=len(vocab), bos_token_id=1, eos_token_id=2)
    mf = ModelFile(convert(tmp_path / "hf", None, tmp_path / "m.gguf", outtype="f32"))
    assert mf.metadata["tokenizer.ggml.pre"] == "gpt-4o"
    text = "abAB abAB, can't 12345"
    ours = HotcoldTokenizer.from_metadata(mf.metadata, source="m.gguf").encode(
        text, add_bos=False, add_eos=False
    )
    assert ours == tk.encode(text).ids
    assert vocab["ab"] in ours and vocab["bA"] not in ours


@pytest.mark.parametrize("pos, t, window", [(0, 7, 0), (5, 4, 3), (9, 1, 4), (9, 1, 0)])
def test_attention_with_sinks_against_a_direct_reference(pos, t, window):
    """ops.attention with sinks (grouped query heads, a window reading only its keys, a chunk at any position)
    against the formula written out in float64: softmax over [q.k / sqrt(Dh) for visible keys, sink], no sink column."""
    from hotcold.ops import attention

    g = torch.Generator().manual_seed(pos * 10 + t)
    h, hkv, dh, n = 4, 2, 8, 16
    q, k, v = (
        torch.randn(t, h, dh, generator=g),
        torch.randn(t, hkv, dh, generator=g),
        torch.randn(t, hkv, dh, generator=g),
    )
    k_cache, v_cache = torch.randn(n, hkv, dh, generator=g), torch.randn(n, hkv, dh, generator=g)
    sinks = torch.randn(h, generator=g) * 2
    expected = torch.empty(t, h, dh, dtype=torch.float64)
    keys, values = k_cache.clone().double(), v_cache.clone().double()
    keys[pos : pos + t], values[pos : pos + t] = k.double(), v.double()
    for i in range(t):
        p = pos + i
        visible = [j for j in range(p + 1) if not window or p - j < window]
        for head in range(h):
            kv = head // (h // hkv)
            logits = torch.stack([q[i, head].double() @ keys[j, kv] / dh**0.5 for j in visible])
            weights = torch.softmax(torch.cat([logits, sinks[head : head + 1].double()]), 0)[:-1]
            expected[i, head] = (weights[:, None] * values[visible, kv]).sum(0)
    got = attention(q, k, v, k_cache, v_cache, pos, sliding_window=window or None, sinks=sinks)
    assert torch.allclose(got.double(), expected.reshape(t, h * dh), atol=1e-5)
