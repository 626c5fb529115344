"""A budgeted load (--ram-budget) computes with the same bits as an unbudgeted one, whatever the budget leaves
resident (0 hot neurons, some, all; with and without the neuron cache), for F16 and Q4_0 files; its reads and cache
are counted; a file changed under it is an error, never other rows; a budget below the always-read part is refused."""

import os
import shutil

import numpy as np
import pytest
import torch

import hotcold
from hotcold.config import config_from_file
from hotcold.gguf.io import GGUFError, ModelFile
from hotcold.placement.walk import GIB
from hotcold.runtime.engine import Engine
from hotcold.storage.plan import plan_ram

CTX = 128
PROMPT = [1, 17, 40, 99, 250, 3, 8, 120, 77, 5]


def run(llm, prompt=PROMPT, steps=6):
    """The prompt's logits (one forward), then greedy decode steps one token at a time: every step's logits."""
    model, tok = llm.loaded.model, llm.loaded.tokenizer
    engine = Engine(model, tok, CTX)
    out = [engine.forward(prompt, 0, last_only=False)]
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(out[-1][-1].argmax()))
        out.append(engine.forward(ids[-1:], len(ids) - 1, last_only=True))
    return out, ids


def budget_for(path, hot: float, cache: float = 0.0) -> tuple[float, float]:
    """(budget in GiB, cache share) that leave `hot` of each layer's neurons resident and room for `cache` of
    them in the neuron cache."""
    mf = ModelFile(path)
    c = config_from_file(mf)
    base = plan_ram(mf, c, 1 << 40, ctx_size=CTX, share=0.0)
    per = [int(f * hot) * b for f, b in zip(base.n_ff, base.per_neuron)]
    room = [int(f * cache) * b for f, b in zip(base.n_ff, base.per_neuron)]
    total = sum(per) + sum(room)
    share = sum(room) / total if total else 0.0
    return (base.always_bytes + total + 64) / GIB, share


@pytest.mark.parametrize("kind", ["f16", "q4_0"])
def test_same_bits_at_every_budget(files, kind, monkeypatch):
    path = files[kind]
    ref = hotcold.load(path, device="cpu", threads=2, ctx_size=CTX)
    want, want_ids = run(ref)
    long_prompt = [(7 * i) % 290 + 3 for i in range(100)]  # a prefill chunk past the GEMM threshold
    want_long = ref.logits(long_prompt)
    cases = ((0.0, 0.0), (0.0, 0.5), (0.5, 0.25), (1.0, 0.0))  # (hot share, cache share of the neurons)
    for hot, cache in cases if kind == "f16" else cases[::2] + cases[-1:]:
        budget, share = budget_for(path, hot, cache)
        monkeypatch.setenv("HOTCOLD_NEURON_CACHE_SHARE", str(share))
        llm = hotcold.load(path, device="cpu", threads=2, ctx_size=CTX, ram_budget=budget)
        store = llm.loaded.storage
        assert llm.decoder == ("cpu_one_call" if hot == 1.0 else "eager")  # all resident: ordinary layers
        assert sum(len(h) for h in store.plan.hot) == pytest.approx(hot * 2 * 256, abs=2)
        got, ids = run(llm)
        assert ids == want_ids
        for a, b in zip(want, got):
            assert torch.equal(a, b), f"{kind} at {hot:.0%} hot, cache {cache:.0%}: logits differ"
        assert torch.equal(llm.logits(long_prompt), want_long)
        figures = store.stats.figures(store.stats.snapshot())
        if hot == 1.0:
            assert figures["storage_bytes_read"] == 0
        else:
            assert figures["storage_bytes_read"] > 0 and figures["storage_bytes_per_token"] > 0
        if cache > 0:
            assert sum(store.plan.cache_slots) > 0
            assert (
                figures["neuron_cache_hit_rate"] > 0
            )  # the second forward of the prompt finds rows read by the first
        llm.loaded.storage.close()


def test_dense_forward_of_a_budgeted_model_is_the_dense_reference(files):
    path = files["f16"]
    dense = hotcold.load(path, device="cpu", threads=2, ctx_size=CTX, dense=True)
    want = dense.logits(PROMPT)
    llm = hotcold.load(path, device="cpu", threads=2, ctx_size=CTX, ram_budget=budget_for(path, 0.25)[0])
    engine = Engine(llm.loaded.model, llm.loaded.tokenizer, CTX)
    engine.seq.dense = True
    assert torch.equal(engine.forward(PROMPT, 0, last_only=False), want)


def test_a_budget_below_what_every_token_reads_is_refused(files):
    with pytest.raises(ValueError, match=r"did not fit: .*output head .*Give at least"):
        hotcold.load(files["f16"], device="cpu", ctx_size=CTX, ram_budget=0.0001)
    with pytest.raises(ValueError, match="ram_budget must be"):
        hotcold.load(files["f16"], device="cpu", ram_budget=float("nan"))
    with pytest.raises(ValueError, match="sparse PowerInfer file run sparsely"):
        hotcold.load(files["f16"], device="cpu", ctx_size=CTX, ram_budget=1.0, dense=True)


@pytest.mark.parametrize("change", ["modified", "truncated"])
def test_a_file_changed_under_a_budget_is_an_error(files, tmp_path, monkeypatch, change):
    monkeypatch.setenv("HOTCOLD_NEURON_CACHE_SHARE", "0")
    path = tmp_path / "m.powerinfer.gguf"
    shutil.copy(files["f16"], path)
    llm = hotcold.load(path, device="cpu", threads=1, ctx_size=CTX, ram_budget=budget_for(path, 0.0)[0])
    offset = llm.loaded.storage.reader.path.stat().st_size
    if change == "modified":  # the same length, other bytes in an FFN row
        m = llm.loaded.model.layers[0].ffn.store.matrices[0]
        with open(path, "r+b") as f:
            f.seek(m.offset + 5)
            f.write(b"\x7f\x7f")
        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    else:
        os.truncate(path, offset - 64)  # the last predictor's tail: the forward never reaches it
    with pytest.raises(GGUFError, match="changed on disk since it was loaded"):
        llm.logits(PROMPT)


def test_hot_neurons_follow_the_statistics(files):
    mf = ModelFile(files["f16"])
    c = config_from_file(mf)
    counts = [np.arange(256, dtype=np.float64)[::-1].copy(), np.zeros(256)]
    counts[1][[5, 9]] = 1e6
    base = plan_ram(mf, c, 1 << 40, ctx_size=CTX, share=0.0)
    plan = plan_ram(
        mf, c, base.always_bytes + 10 * base.per_neuron[0], ctx_size=CTX, counts=counts, share=0.0
    )
    assert plan.hot[1].tolist() == [5, 9]
    assert plan.hot[0].tolist() == list(range(8))  # the most counted of layer 0: the lowest indices here
    unordered = plan_ram(mf, c, base.always_bytes + 10 * base.per_neuron[0], ctx_size=CTX, share=0.0)
    assert [h.tolist() for h in unordered.hot] == [list(range(5))] * 2
    assert "index order" in unordered.describe()


def test_token_groups_keep_the_gathered_rows_within_the_cap():
    from hotcold.storage.ffn import token_groups

    mask = np.zeros((5, 8), dtype=bool)
    mask[0, [0, 1]] = mask[1, [1, 2]] = mask[2, [3, 4, 5, 6, 7]] = mask[3, [0]] = mask[4, [0, 1]] = True
    assert token_groups(mask, 8) == [(0, 5)]
    assert token_groups(mask, 3) == [(0, 2), (2, 3), (3, 5)]  # token 2 alone: it selects more than the cap


def test_a_batch_of_sequences_under_a_budget_generates_what_an_unbudgeted_batch_does(files):
    path = files["f16"]
    prompts = ["Once upon a time", "The cat", "In a hole in the ground there lived"]
    ref = hotcold.load(path, device="cpu", threads=2, ctx_size=CTX, kv_sequences=3)
    budget = budget_for(path, 0.5)[0] + 3 * 2 * 2 * CTX * 32 * 4 / GIB  # room for the two more KV caches
    llm = hotcold.load(path, device="cpu", threads=2, ctx_size=CTX, kv_sequences=3, ram_budget=budget)
    assert 0 < sum(len(h) for h in llm.loaded.storage.plan.hot) < 512
    want = ref.generate_batch(prompts, max_tokens=6, ignore_eos=True)
    assert llm.generate_batch(prompts, max_tokens=6, ignore_eos=True) == want


def test_bench_reports_the_bytes_a_token_reads_from_the_file(files, capsys):
    """`hotcold bench --ram-budget`: the decode runs from storage and its rows say how many bytes a token read."""
    import json

    from hotcold.cli import main

    budget = budget_for(files["f16"], 0.1)[0]  # at CTX: bench's context (n + 2) must be near it
    argv = [
        "bench",
        "-m",
        str(files["f16"]),
        "-p",
        "0",
        "-n",
        str(CTX - 4),
        "-r",
        "1",
        "-t",
        "1",
        "--mode",
        "sparse",
    ]
    assert main([*argv, "--ram-budget", f"{budget:.9f}", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["storage_bytes_per_token"] > 0
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["storage_bytes_per_token"] is None
