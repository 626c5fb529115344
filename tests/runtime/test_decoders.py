"""The decoder chosen once at load (hotcold.runtime.decoders): which one, the eager one on request, the fallback when a
fast one fails on its first step, and where it is reported. Each family's decoder against the eager one on the
same file is in tests/fixtures.run_family_checks."""

from __future__ import annotations

import json

import pytest
import torch

import hotcold
from hotcold.kernels import cpu
from hotcold.runtime import cpu_step
from hotcold.runtime.engine import Engine

needs_c = pytest.mark.skipif(cpu.backend() != "c", reason="C kernels unavailable")


@pytest.fixture(scope="module")
def q4_sparse(tmp_path_factory, tiny_sparse_gguf):
    from hotcold.convert.quantize import quantize_file

    return quantize_file(tiny_sparse_gguf, tmp_path_factory.mktemp("dec") / "m.q4_0.gguf", "q4_0")


@needs_c
def test_auto_picks_the_one_call_decoder_on_the_cpu_and_eager_is_the_same_tokens(q4_sparse):
    fast = hotcold.load(q4_sparse, device="cpu", threads=2)
    eager = hotcold.load(q4_sparse, device="cpu", threads=2, decoder="eager")
    assert fast.decoder == "cpu_one_call" and eager.decoder == "eager"
    assert any(n.startswith("decode: cpu_one_call") for n in fast.loaded.notes)
    assert any("decoder='eager'" in n for n in eager.loaded.notes)
    prompt = [1, 5, 9, 300]
    assert fast.generate(prompt, max_tokens=12, ignore_eos=True) == eager.generate(
        prompt, max_tokens=12, ignore_eos=True
    )
    assert eager.loaded.model.cpu_decode is None and eager.loaded.model.static_step is None


def test_a_bad_decoder_request_names_the_choices(tiny_sparse_gguf):
    with pytest.raises(ValueError, match="decoder must be one of 'auto', 'eager'"):
        hotcold.load(tiny_sparse_gguf, device="cpu", decoder="cuda_graph")


def test_a_float32_file_decodes_eagerly_and_says_why(tiny_sparse_gguf):
    llm = hotcold.load(tiny_sparse_gguf, device="cpu")
    assert llm.decoder == "eager"
    assert any("float32 q/k/v" in n for n in llm.loaded.notes), llm.loaded.notes


@needs_c
def test_a_first_step_failure_hands_the_model_to_the_eager_decoder(q4_sparse, monkeypatch):
    """hc_decode_step failing on the first decode token: that token and every later one run layer by layer, with
    the eager decoder's tokens; the model says it fell back, and why."""
    want = hotcold.load(q4_sparse, device="cpu", threads=2, decoder="eager").generate(
        [1, 5, 9], max_tokens=8, ignore_eos=True
    )
    llm = hotcold.load(q4_sparse, device="cpu", threads=2)
    calls = []

    def failing(plans, x, ctx):
        calls.append(1)
        raise MemoryError("hc_decode_step failed")

    monkeypatch.setattr(cpu_step, "_run", failing)
    assert llm.generate([1, 5, 9], max_tokens=8, ignore_eos=True) == want
    assert calls == [1]  # tried once, then never again
    assert llm.decoder == "eager"
    assert llm.loaded.model.decoder_failure == "cpu_one_call: MemoryError: hc_decode_step failed"


@needs_c
def test_a_failure_after_a_good_step_is_an_error(q4_sparse, monkeypatch):
    llm = hotcold.load(q4_sparse, device="cpu", threads=2)
    llm.generate([1, 5, 9], max_tokens=2, ignore_eos=True)
    monkeypatch.setattr(cpu_step, "_run", lambda plans, x, ctx: (_ for _ in ()).throw(MemoryError("out")))
    with pytest.raises(MemoryError, match="out"):
        llm.generate([1, 5, 9], max_tokens=4, ignore_eos=True)
    assert llm.decoder == "cpu_one_call"


@needs_c
def test_plans_live_in_each_sequence_not_on_the_model(q4_sparse):
    llm = hotcold.load(q4_sparse, device="cpu", threads=2)
    model = llm.loaded.model
    engines = [Engine(model, llm.tokenizer, 32) for _ in range(2)]
    for e in engines:
        e.prefill([1, 5, 9])
        e.forward([7], 3, last_only=True)
    plans = [e.seq.decode_plans[False] for e in engines]
    assert plans[0] is not None and plans[1] is not None and plans[0] is not plans[1]
    assert plans[0].kv is engines[0].seq.kv and plans[1].kv is engines[1].seq.kv
    assert not any(isinstance(v, dict) for v in vars(model.cpu_decode).values())  # no per-sequence table


@needs_c
def test_bench_rows_and_info_name_the_decoder(q4_sparse, capsys):
    from hotcold.cli import main

    assert main(["bench", "-m", str(q4_sparse), "-p", "4", "-n", "2", "-r", "1", "-t", "2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows and {r["decoder"] for r in rows} == {"cpu_one_call"}
    assert main(["bench", "-m", str(q4_sparse), "-p", "0", "-n", "2", "-r", "1", "-t", "2", "--json",
                 "--decoder", "eager"]) == 0  # fmt: skip
    assert {r["decoder"] for r in json.loads(capsys.readouterr().out)} == {"eager"}
    assert main(["info", "-m", str(q4_sparse), "--load", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["decoder"] == "cpu_one_call" and "one C call" in info["decoder_why"]


def _sparse_family_file(family: str, folder, spm_model_file, outtype: str):
    """A sparse file (random predictors, so neurons fire and stay silent) of a LayerNorm family."""
    from hotcold.convert import convert
    from tests.fixtures import write_predictors

    if family.startswith("mixtral"):
        import json

        from tests.models.test_mixtral import CASES as MIXTRAL
        from tests.models.test_mixtral import N_EXPERT, make_mixtral

        make_mixtral(folder / "hf", spm_model_file, seed=2, **MIXTRAL[family.split(":")[1]])
        for e in range(N_EXPERT):
            write_predictors(folder / "pred" / f"expert_{e}", 2, 64, 1280, seed=10 + e)
        (folder / "pred" / "config.json").write_text(json.dumps({"sparse_threshold": 0.0}))
        return convert(folder / "hf", folder / "pred", folder / f"sparse.{outtype}.gguf", outtype=outtype)
    if family.startswith("falcon"):
        from tests.models.test_falcon import CASES, make_falcon

        make_falcon(folder / "hf", spm_model_file, **CASES[family.split(":")[1]])
    else:
        from tests.models.test_opt import make_opt

        make_opt(folder / "hf", spm_model_file)
    write_predictors(folder / "pred", 2, 64, 1280, seed=5)
    return convert(folder / "hf", folder / "pred", folder / f"sparse.{outtype}.gguf", outtype=outtype)


@needs_c
@pytest.mark.parametrize(
    "family, outtype",
    [
        ("falcon:7b-multi-query", "f16"),
        ("falcon:40b-grouped-kv", "q8_0"),
        ("opt", "f16"),
        ("opt", "q4_0"),
        ("mixtral:relu", "f16"),
        ("mixtral:drelu", "q4_0"),
    ],
)
def test_every_family_decodes_in_one_call_with_the_layers_bits(tmp_path, spm_model_file, family, outtype):
    """Sparse Falcon (LayerNorm, parallel residual, NeoX RoPE, q/k/v split from attn_qkv), OPT (LayerNorm, biases,
    learned positions) and Mixtral (a router over experts with predictors; dReLU as TurboSparse): the one-call
    decoder's decode steps equal the eager decoder's bit for bit, alone and in a batch, with the same firing
    counts (and for Mixtral the same experts recorded)."""
    from tests.fixtures import decode_logits, random_ids

    path = _sparse_family_file(family, tmp_path, spm_model_file, outtype)
    fast = hotcold.load(path, device="cpu", threads=2)
    eager = hotcold.load(path, device="cpu", threads=2, decoder="eager")
    assert fast.decoder == "cpu_one_call", fast.loaded.notes
    assert not fast.loaded.dense
    ids = random_ids(16, seed=9)
    got, want = decode_logits(fast, ids, 4), decode_logits(eager, ids, 4)
    assert torch.equal(got, want), (got - want).abs().max()
    assert fast.loaded.model.cpu_decode.steps == len(ids) - 4  # every decode step ran in the one call
    routing = [m.engine.seq.routing for m in (fast, eager)]
    assert routing[0].keys() == routing[1].keys()
    assert all(torch.equal(routing[0][i], routing[1][i]) for i in routing[0])
    assert fast.engine.seq.neuron_totals() == eager.engine.seq.neuron_totals()
    computed, total = fast.engine.seq.neuron_totals()
    assert 0 < computed < total  # sparse: some neurons skipped, some computed
    prompts = [random_ids(n, seed=30 + n) for n in (2, 5, 9)]
    kwargs = dict(max_tokens=6, ignore_eos=True)
    assert fast.generate_batch(prompts, **kwargs) == eager.generate_batch(prompts, **kwargs)
    counts = [[(s.neurons_computed, s.neurons_total) for s in m.last_batch_stats] for m in (fast, eager)]
    assert counts[0] == counts[1]
