"""The placement cache keeps the original's layout, so PowerInfer reads ours and we read its."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from hotcold.gguf.io import GGUFError, ModelFile
from hotcold.placement.gpuidx import Placement, read_gpuidx, write_gpuidx


def test_round_trip_and_layout(tmp_path):
    rng = np.random.default_rng(0)
    hot = [np.sort(rng.choice(1280, k, replace=False)) for k in (0, 256, 1280, 512)]
    placement = Placement(hot, [1280] * 4, 123_456_789, {"hotcold.model_size": "42"})
    path = write_gpuidx(tmp_path / "m.gguf.generated.gpuidx", placement)
    raw = path.read_bytes()
    assert raw[:4] == b"PWRI"
    mf = ModelFile(path)
    assert mf.metadata["general.architecture"] == "generic.gpu_index"
    assert mf.metadata["generic.gpu_index.block_count"] == 4
    assert mf.metadata["split.vram_capacity"] == 123_456_789
    # tensors in layer order, gpu_idx then gpu_bucket, integer type 18 (PowerInfer's I32)
    assert list(mf.tensors) == [f"blk.{i}.{t}" for i in range(4) for t in ("gpu_idx", "gpu_bucket")]
    assert raw.count(struct.pack("<I", 18)) >= 8
    assert list(mf.tensors["blk.1.gpu_idx"].data.nonzero()[0]) == list(hot[1])
    back = read_gpuidx(path)
    assert back.vram_capacity == 123_456_789 and back.n_ff == [1280] * 4
    assert all(np.array_equal(a, b) for a, b in zip(back.hot, hot))
    assert back.source == {"hotcold.model_size": "42"}


def test_layers_in_numeric_order_beyond_ten(tmp_path):
    """The original's solver sorted activation files as strings (blk.2 got activation_10); ours does not."""
    hot = [np.arange(256 * (i % 3), 256 * (i % 3) + 256) for i in range(12)]
    path = write_gpuidx(tmp_path / "x.gpuidx", Placement(hot, [1024] * 12, 1, {}))
    names = list(ModelFile(path).tensors)
    assert names[4] == "blk.2.gpu_idx" and names[20] == "blk.10.gpu_idx"
    assert all(np.array_equal(a, b) for a, b in zip(read_gpuidx(path).hot, hot))


def test_inconsistent_file_rejected(tmp_path):
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFValueType as V

    from hotcold.gguf.io import TensorSpec, write_model_file

    idx = np.zeros(256, dtype=np.int32)
    idx[:3] = 1
    bucket = np.array([0, 1, 7], dtype=np.int32)
    write_model_file(
        tmp_path / "bad.gpuidx",
        "generic.gpu_index",
        [("split.vram_capacity", 5, V.UINT64)],
        [
            TensorSpec("blk.0.gpu_idx", (256,), Q.I32, lambda: idx),
            TensorSpec("blk.0.gpu_bucket", (3,), Q.I32, lambda: bucket),
        ],
        sparse=True,
    )
    with pytest.raises(GGUFError, match="gpu_bucket does not list"):
        read_gpuidx(tmp_path / "bad.gpuidx")


def test_never_written_over_its_model_or_statistics(tmp_path):
    """The cache's inputs (its model file, the activation files) are found from its path and refused as
    outputs: a cache name that is a link to the model must not replace the model."""
    from hotcold.atomic import OutputError
    from hotcold.placement.gpuidx import gpuidx_path, placement_inputs

    model = tmp_path / "m.gguf"
    model.write_bytes(b"model bytes")
    (tmp_path / "activation").mkdir()
    (tmp_path / "activation" / "activation_0.pt").write_bytes(b"stats")
    cache = gpuidx_path(model)
    assert placement_inputs(cache) == [model, tmp_path / "activation" / "activation_0.pt"]
    placement = Placement([np.arange(4)], [16], 1 << 20, {})
    for target in (model, tmp_path / "activation" / "activation_0.pt"):
        cache.unlink(missing_ok=True)
        cache.symlink_to(target)
        with pytest.raises(OutputError, match="would be overwritten"):
            write_gpuidx(cache, placement)
    assert model.read_bytes() == b"model bytes"
    cache.unlink()
    write_gpuidx(cache, placement)
    assert read_gpuidx(cache).hot[0].tolist() == [0, 1, 2, 3]


def test_where_the_cache_goes(tmp_path, monkeypatch):
    """Beside a model in a user's folder (PowerInfer's place); in the user cache for a model inside the
    installed package, one file per model path; the loader looks beside first, then in the cache."""
    import hotcold
    from hotcold.placement.gpuidx import gpuidx_candidates, gpuidx_path

    monkeypatch.setenv("HOTCOLD_CACHE_DIR", str(tmp_path / "cache"))
    mine = tmp_path / "models" / "m.gguf"
    mine.parent.mkdir()
    assert gpuidx_path(mine) == tmp_path / "models" / "m.gguf.generated.gpuidx"
    package = tmp_path / "site-packages" / "hotcold"
    monkeypatch.setattr(hotcold, "__file__", str(package / "__init__.py"))
    bundled, other = package / "data" / "m.gguf", package / "data" / "sub" / "m.gguf"
    assert gpuidx_path(bundled).parent == tmp_path / "cache" / "gpuidx"
    assert gpuidx_path(bundled).name.startswith("m.gguf.") and gpuidx_path(bundled) != gpuidx_path(other)
    assert gpuidx_candidates(bundled) == [package / "data" / "m.gguf.generated.gpuidx", gpuidx_path(bundled)]
    assert gpuidx_path(mine) == tmp_path / "models" / "m.gguf.generated.gpuidx"
