"""loader.neuron_order: a model loaded for several sequences keeps its sparse FFN rows hottest first (by the
activation statistics beside it), computing the same function; what it records stays in the file's order."""

from __future__ import annotations

import pytest
import torch

import hotcold
from hotcold.loader import load_model
from tests.fixtures import record_masks, with_activation_stats

PROMPTS = ["Line 3: the quick brown fox", "Line 7: a lazy dog", "Once upon a time"]


@pytest.fixture()
def model_with_stats(tmp_path, tiny_sparse_gguf):
    return with_activation_stats(tiny_sparse_gguf, tmp_path, high=50)  # ties: kept in the file's order


def _ffn(loaded, layer: int):
    return loaded.model.layers[layer].ffn


def test_rows_are_kept_hottest_first(model_with_stats):
    path, counts = model_with_stats
    ordered = load_model(path, device="cpu", kv_sequences=2)
    stored = load_model(path, device="cpu")  # one sequence: the file's order, nothing copied
    assert any("hottest first" in n for n in ordered.notes)
    assert _ffn(stored, 0).weights.order is None
    p = torch.randn(3, ordered.config.n_embd)
    for layer in range(2):
        w, s = _ffn(ordered, layer).weights, _ffn(stored, layer).weights
        order = w.order
        assert torch.equal(order, torch.argsort(counts[layer], descending=True, stable=True))
        assert counts[layer][order[0]] == counts[layer].max()
        for name in ("up", "gate", "down_t"):
            assert torch.equal(getattr(w, name), getattr(s, name)[order]), name
        want = _ffn(stored, layer).predictor.logits(p)[:, order]
        assert torch.equal(_ffn(ordered, layer).predictor.logits(p), want)


def test_ordered_model_computes_the_same_function(model_with_stats):
    path, _ = model_with_stats
    ordered = hotcold.Model(load_model(path, device="cpu", kv_sequences=2))
    stored = hotcold.Model(load_model(path, device="cpu"))
    ids = list(range(3, 40))
    want = stored.logits(ids)
    assert torch.allclose(ordered.logits(ids), want, rtol=0, atol=1e-5 * float(want.abs().max()))
    for prompt in PROMPTS:
        got = ordered.generate(prompt, max_tokens=12, temperature=0, ignore_eos=True)
        assert got == stored.generate(prompt, max_tokens=12, temperature=0, ignore_eos=True)
    # and a batch is still each request alone, in the ordered model
    batch = ordered.generate_batch(PROMPTS, max_tokens=12, temperature=0, ignore_eos=True)
    for prompt, got in zip(PROMPTS, batch, strict=True):
        assert got == ordered.generate(prompt, max_tokens=12, temperature=0, ignore_eos=True)


def test_recorded_masks_and_activations_are_in_file_order(model_with_stats):
    path, _ = model_with_stats
    ordered = hotcold.Model(load_model(path, device="cpu", kv_sequences=2))
    stored = hotcold.Model(load_model(path, device="cpu"))
    ids = list(range(3, 20))
    masks = []
    for llm in (ordered, stored):
        rec = record_masks(llm)
        llm.logits(ids)
        masks.append([rec[i]["mask"].clone() for i in range(2)])
    for got, want in zip(*masks, strict=True):
        assert torch.equal(got, want)
    seen = {}
    for name, llm in (("ordered", ordered), ("stored", stored)):
        acts = []
        llm.engine.logits(ids, observe=lambda layer, _x, _p, a, acts=acts: acts.append((layer, a.clone())))
        seen[name] = acts
    for (la, a), (lb, b) in zip(seen["ordered"], seen["stored"], strict=True):
        assert la == lb and torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_file_order_when_asked_or_when_the_statistics_are_unreadable(model_with_stats, monkeypatch):
    path, _ = model_with_stats
    monkeypatch.setenv("HOTCOLD_NEURON_ORDER", "0")
    off = load_model(path, device="cpu", kv_sequences=2)
    assert _ffn(off, 0).weights.order is None and any("HOTCOLD_NEURON_ORDER=0" in n for n in off.notes)
    monkeypatch.delenv("HOTCOLD_NEURON_ORDER")
    torch.save(torch.zeros(7, dtype=torch.int64), path.parent / "activation" / "activation_1.pt")
    bad = load_model(path, device="cpu", kv_sequences=2)
    assert _ffn(bad, 0).weights.order is None
    assert any("activation_1.pt" in n and "file's order" in n for n in bad.notes)
    stored = hotcold.Model(load_model(path, device="cpu"))
    for llm in (
        hotcold.Model(off),
        hotcold.Model(bad),
    ):  # both run the file's order, as a single-sequence load
        assert llm.generate("hello", max_tokens=6, temperature=0) == stored.generate(
            "hello", max_tokens=6, temperature=0
        )


def test_a_layer_stored_hottest_first_is_not_copied(model_with_stats):
    path, counts = model_with_stats
    torch.save(torch.arange(1280, 0, -1), path.parent / "activation" / "activation_1.pt")  # already in order
    loaded = load_model(path, device="cpu", kv_sequences=2)
    assert any("1 of 2 layers reordered" in n for n in loaded.notes)
    assert _ffn(loaded, 0).weights.order is not None and _ffn(loaded, 1).weights.order is None
    stored = load_model(path, device="cpu")
    assert torch.equal(_ffn(loaded, 1).weights.up, _ffn(stored, 1).weights.up)  # the file's rows, as stored
