"""Under a RAM budget a request's timings, the generate line and /metrics say what was read from the model file
and how often the neuron cache held a cold row; without one they say nothing of it."""

import pytest

import hotcold
from hotcold.cli.generate import _storage_text
from hotcold.config import config_from_file
from hotcold.gguf.io import ModelFile
from hotcold.placement.walk import GIB
from hotcold.server.figures import timings
from hotcold.server.metrics import Metrics
from hotcold.storage.plan import plan_ram

CTX = 128


def test_timings_and_metrics_count_the_reads(files, monkeypatch):
    monkeypatch.setenv("HOTCOLD_NEURON_CACHE_SHARE", "0.5")
    mf = ModelFile(files["f16"])
    base = plan_ram(mf, config_from_file(mf), 1 << 40, ctx_size=CTX, share=0.0)
    budget = (base.always_bytes + 2 * 64 * base.per_neuron[0]) / GIB  # a quarter of the neurons, half a cache
    llm = hotcold.load(files["f16"], device="cpu", threads=1, ctx_size=CTX, ram_budget=budget)
    llm.generate("Once upon a time", max_tokens=8, ignore_eos=True)
    first = llm.last_stats
    t = timings([first], hybrid=False)
    tokens = first.storage["tokens"]
    assert tokens == first.prompt_computed + first.generated_tokens - 1  # the last token is sampled, not run
    assert t["storage_bytes_read"] == first.storage["bytes_read"] > 0
    assert t["storage_bytes_per_token"] == pytest.approx(t["storage_bytes_read"] / tokens)
    assert 0 <= t["neuron_cache_hit_rate"] <= 1
    assert "MiB/token read, neuron cache hits" in _storage_text(first)
    text = Metrics().render(
        queue_depth=0, busy=0, parallel=1, cancelled=0, storage=llm.loaded.model.storage_stats
    )
    assert f"hotcold_storage_bytes_read_total {first.storage['bytes_read']}" in text
    assert "hotcold_neuron_cache_hit_rate " in text

    plain = hotcold.load(files["f16"], device="cpu", threads=1, ctx_size=CTX)
    plain.generate("Once upon a time", max_tokens=2)
    assert plain.last_stats.storage is None
    assert "storage_bytes_read" not in timings([plain.last_stats], hybrid=False)
    assert "hotcold_storage" not in Metrics().render(queue_depth=0, busy=0, parallel=1, cancelled=0)


def test_info_prints_the_plan(files, capsys):
    from hotcold.cli import main

    assert main(["info", "-m", str(files["f16"]), "--ram-budget", "0.05", "-c", str(CTX)]) == 0
    out = capsys.readouterr().out
    assert "RAM budget 0.05 GiB" in out and "hot FFN neurons 100.0%" in out and "process before load" in out
    assert main(["info", "-m", str(files["f16"]), "--ram-budget", "0.0001", "-c", str(CTX)]) == 1
    err = capsys.readouterr().err
    assert "--ram-budget 0.0001 GiB is below what every token reads" in err and "did not fit: KV cache" in err


def test_the_flag_is_checked_before_loading(files, capsys):
    from hotcold.cli import main

    assert main(["generate", "-m", str(files["f16"]), "--ram-budget", "-1", "-p", "x"]) == 1
    assert "--ram-budget must be a finite number in [0," in capsys.readouterr().err


def test_tokens_are_counted_when_the_first_layer_is_all_resident(files, tmp_path, monkeypatch):
    """A first layer whose neurons all fit is an ordinary sparse layer: the first stored layer counts the tokens,
    so the per-token figures are not 0 (they were: only a stored layer 0 counted)."""
    import shutil

    import torch

    from hotcold.storage.ffn import StoredFFN

    monkeypatch.setenv("HOTCOLD_NEURON_CACHE_SHARE", "0")
    model = tmp_path / "t16.powerinfer.gguf"
    shutil.copy(files["f16"], model)
    (tmp_path / "activation").mkdir()
    torch.save(
        torch.full((256,), 5000.0), tmp_path / "activation" / "activation_0.pt"
    )  # layer 0: all hottest
    torch.save(torch.arange(256.0), tmp_path / "activation" / "activation_1.pt")
    mf = ModelFile(model)
    base = plan_ram(mf, config_from_file(mf), 1 << 40, ctx_size=CTX, share=0.0)
    budget = (base.always_bytes + 256 * base.per_neuron[0] + 100 * base.per_neuron[1]) / GIB
    llm = hotcold.load(model, device="cpu", threads=1, ctx_size=CTX, ram_budget=budget)
    stored = [isinstance(layer.ffn, StoredFFN) for layer in llm.loaded.model.layers]
    assert stored == [False, True], stored
    llm.generate("Once upon a time", max_tokens=4, ignore_eos=True)
    stats = llm.last_stats
    assert stats.storage["tokens"] == stats.prompt_computed + stats.generated_tokens - 1 > 0
    assert timings([stats], hybrid=False)["storage_bytes_per_token"] > 0
