"""A model file rewritten with every tensor at a page boundary (`general.alignment` 4096; GGUF's default is 32), so
that an FFN row of a page's size (F16 rows of 2048 values) is one page read from storage instead of two. The
tensors' bytes and the metadata are copied unchanged; the activation statistics are copied beside the new file.

    python -m hotcold.storage.align IN.gguf OUT.gguf
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
from gguf import GGUFValueType

from hotcold.gguf.io import ModelFile, TensorSpec, metadata_items, write_model_file
from hotcold.storage.reader import PAGE


def align_file(src: str | Path, dst: str | Path, *, alignment: int = PAGE) -> Path:
    mf = ModelFile(src)
    meta = [m for m in metadata_items(mf) if m[0] != "general.alignment"]
    meta.append(("general.alignment", alignment, GGUFValueType.UINT32))
    specs = [
        TensorSpec(e.name, e.shape, e.qtype, lambda e=e: np.asarray(e.data)) for e in mf.tensors.values()
    ]
    out = write_model_file(dst, mf.architecture, meta, specs, sparse=mf.is_sparse, inputs=[src])
    stats, dst_stats = Path(src).parent / "activation", Path(dst).parent / "activation"
    if stats.is_dir() and not dst_stats.exists():
        shutil.copytree(stats, dst_stats)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    print(f"wrote {align_file(sys.argv[1], sys.argv[2])}")
