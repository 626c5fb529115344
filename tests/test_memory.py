"""hotcold.memory: what a process can still take (the machine's and its cgroups' limits), and the load that keeps a
model's weights in the file's pages when packed copies would not fit (a model larger than memory is not killed)."""

from __future__ import annotations

import torch

import hotcold
from hotcold import memory
from hotcold.gguf.quants import QuantTensor

GIB = 1 << 30


def test_cgroup_v2_headroom_is_the_least_over_the_group_and_its_parents(tmp_path):
    (tmp_path / "user/app").mkdir(parents=True)
    (tmp_path / "user/memory.max").write_text(f"{8 * GIB}\n")
    (tmp_path / "user/memory.current").write_text(f"{7 * GIB}\n")
    (tmp_path / "user/app/memory.max").write_text("max\n")  # no limit of its own: the parent's binds
    (tmp_path / "user/app/memory.current").write_text(f"{GIB}\n")
    assert memory.cgroup_headroom("0::/user/app\n", root=tmp_path) == GIB
    (tmp_path / "user/app/memory.max").write_text(f"{GIB + 5}\n")
    assert memory.cgroup_headroom("0::/user/app\n", root=tmp_path) == 5


def test_cgroup_v1_and_no_limit(tmp_path):
    group = tmp_path / "memory/box"
    group.mkdir(parents=True)
    (group / "memory.limit_in_bytes").write_text(f"{3 * GIB}\n")
    (group / "memory.usage_in_bytes").write_text(f"{GIB}\n")
    assert memory.cgroup_headroom("4:memory:/box\n3:cpu,cpuacct:/box\n", root=tmp_path) == 2 * GIB
    (group / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "unlimited"
    assert memory.cgroup_headroom("4:memory:/box\n", root=tmp_path) == memory.UNKNOWN
    assert memory.cgroup_headroom("", root=tmp_path) == memory.UNKNOWN
    assert 0 < memory.available_memory() <= memory.machine_available()


def test_fits_packed_says_why_not():
    notes: list[str] = []
    assert memory.fits_packed(2 * GIB, notes, available=4 * GIB) and not notes
    assert not memory.fits_packed(4 * GIB, notes, available=4 * GIB)
    assert "do not fit" in notes[0] and "--ram-budget" in notes[0]


def packed_weights(llm) -> int:
    layer = llm.loaded.model.layers[0]
    return sum(isinstance(w, QuantTensor) and w.packed is not None for w in layer.qkv.weights)


def test_a_model_larger_than_memory_loads_unpacked_and_generates(monkeypatch):
    """With too little memory for packed copies the weights stay in the file's pages (no packed copy, no head
    screen), a load note says so, and the model decodes as before: logits within float rounding of the packed
    load's (packed and row-layout products sum in different orders), the same greedy tokens."""
    roomy = hotcold.load(None, threads=1)
    assert packed_weights(roomy) > 0
    monkeypatch.setattr(memory, "available_memory", lambda: 64 << 20)
    tight = hotcold.load(None, threads=1)
    assert packed_weights(tight) == 0 and getattr(tight.loaded.model.head, "screen", None) is None
    assert any("do not fit" in n for n in tight.loaded.notes), tight.loaded.notes
    ids = list(range(5, 30))
    a, b = roomy.logits(ids), tight.logits(ids)
    assert torch.allclose(a, b, rtol=0, atol=1e-4 * a.abs().max())
    assert tight.generate([1, 5, 9], max_tokens=12, ignore_eos=True) == roomy.generate(
        [1, 5, 9], max_tokens=12, ignore_eos=True
    )
