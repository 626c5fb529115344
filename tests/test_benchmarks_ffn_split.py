"""benchmarks/ffn_split.py on a tiny synthetic: the masks it captures are the kernels' (rows hottest first), every
case is timed and checked, and files it cannot split are refused with the reason."""

import json
from types import SimpleNamespace

import pytest
import torch

from benchmarks import ffn_split
from benchmarks.synth import synthesize


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ffn_split")
    shape = dict(n_embd=64, n_ff=256, n_layer=2, n_head=4, n_head_kv=2, rank=16, n_vocab=300)
    f16 = folder / "t16.powerinfer.gguf"
    synthesize(f16, **shape)
    f32 = folder / "t32.powerinfer.gguf"
    synthesize(f32, **shape, outtype="f32")
    return f16, f32


def test_masks_come_back_in_the_order_of_the_rows():
    order = torch.tensor([2, 0, 3, 1])  # row i is the file's neuron order[i]
    layer = SimpleNamespace(ffn=SimpleNamespace(weights=SimpleNamespace(order=order)))
    llm = SimpleNamespace(loaded=SimpleNamespace(model=SimpleNamespace(layers=[layer])))
    file_order = torch.tensor([[True, False, False, True]])  # neurons 0 and 3 fired
    (rows,) = ffn_split.in_row_order(llm, [file_order])
    assert rows.tolist() == [[False, True, True, False]]  # rows 1 (neuron 0) and 2 (neuron 3)


def test_every_case_is_timed_and_the_split_agrees(tiny, tmp_path):
    out = tmp_path / "split.json"
    res = ffn_split.main(
        ["-m", str(tiny[0]), "-t", "1", "--batch", "3", "--prompt", "6", "--hot", "64,128", "--rounds", "1"]
        + ["--json", str(out)]
    )
    assert json.loads(out.read_text()) == res
    cases = res["cases"]
    assert [(c["what"], c["tokens"], c["hot_rows"]) for c in cases] == [
        ("decode", 1, 64),
        ("decode", 1, 128),
        ("batch 3", 3, 64),
        ("batch 3", 3, 128),
        ("prompt 6", 6, 64),
        ("prompt 6", 6, 128),
    ]
    for c in cases:
        assert set(c["ms"]) == {"gate_whole", "gate_split", "down_whole", "down_split"}
        assert all(v > 0 for v in c["ms"].values())
        assert 0 < c["firing_per_token"] <= c["union"] <= 1
        assert c["largest_difference"]["gate"] < 1e-3 and c["largest_difference"]["down"] < 1e-3
    # the loader keeps the synthetic's neurons hottest first: the first rows fire most
    first = next(c for c in cases if c["what"] == "prompt 6" and c["hot_rows"] == 64)
    assert first["hot_rows_firing_per_token"] > first["firing_per_token"]


def test_refuses_what_it_cannot_split(tiny, capsys):
    with pytest.raises(SystemExit, match="float16 or bfloat16"):
        ffn_split.main(["-m", str(tiny[1]), "--batch", "1", "--prompt", "1", "--hot", "64", "--rounds", "1"])
    with pytest.raises(SystemExit, match=r"--hot sizes must be 1\.\.255"):
        ffn_split.main(["-m", str(tiny[0]), "--batch", "1", "--prompt", "1", "--hot", "256", "--rounds", "1"])
