"""A tiny synthetic PowerInfer file (F16) and its Q4_0 copy, shared by the storage tests."""

import pytest

from benchmarks.synth import synthesize

SHAPE = dict(n_embd=64, n_ff=256, n_layer=2, n_head=4, n_head_kv=2, rank=16, n_vocab=300, firing=0.2)


@pytest.fixture(scope="session")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("storage")
    f16 = folder / "t16.powerinfer.gguf"
    synthesize(f16, **SHAPE)
    from hotcold.convert.quantize import quantize_file

    q40 = folder / "q4" / "t.q4_0.powerinfer.gguf"
    q40.parent.mkdir()
    quantize_file(f16, q40, "q4_0")
    return {"f16": f16, "q4_0": q40}
