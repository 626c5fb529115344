"""Shared builders for tests: tiny Hugging Face checkpoints with real tokenizers, made offline."""

from __future__ import annotations

import json
from pathlib import Path

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
    from hotcold.sampling import SamplingParams

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
    from hotcold.sparse.ffn import FFNWeights

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
        from hotcold.state import Batch, FFNCounts, SequenceState

        seq = SequenceState(None, [FFNCounts() for _ in range(n_layer)], dense=dense, observe=observe)
        batch = Batch.single(seq, 0, 0)
        batch.counts = seq.counts
        return batch


ffn_state = _FFNState


def run_family_checks(path, hf, *, greedy: bool = True, rel: float = 1e-4) -> None:
    """The checks every family passes, run the same way for each (as mlx-lm's shared model runner):
    logits == transformers' on 40 random tokens; greedy tokens == transformers' generate (unless greedy is
    False); cached decode == one full forward; a generation split in two == the same generation in one go
    (the second half reuses the cached prefix)."""
    import hotcold
    from hotcold.sampling import SamplingParams

    llm = hotcold.load(path, device="cpu")
    assert_logits_match(llm, hf, random_ids(40), rel)
    if greedy:
        assert_greedy_matches(llm, hf)

    ids = random_ids(24, seed=2)
    full = llm.logits(ids)
    engine = llm.engine
    engine.cached_ids = []
    stepwise = [engine.prefill(ids[:10])]
    for pos in range(10, 24):
        stepwise.append(engine._forward([ids[pos]], pos, last_only=True)[-1])
    assert torch.allclose(torch.stack(stepwise), full[9:], atol=rel * full.abs().max())

    prompt = llm.tokenize("Line 12: the")
    steps = engine.generate_step(prompt, SamplingParams())
    first = [next(steps) for _ in range(16)]
    steps.close()
    steps = engine.generate_step(prompt + first[:8], SamplingParams())
    assert [next(steps) for _ in range(8)] == first[8:]
