"""Where hotcold writes what belongs to a model whose folder it must not write into: the bundled demo model
inside the installed package (installing or upgrading would replace it, and it is not the user's folder) or
a read-only folder. Such files go to hotcold's cache folder, the one the compiled kernels use, under the
model's name and a digest of its path: placement caches (placement.gpuidx) and activation statistics
(placement.profile)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def cache_root() -> Path:
    """hotcold's cache folder, the one the compiled kernels use: HOTCOLD_CACHE_DIR, else
    $XDG_CACHE_HOME/hotcold or ~/.cache/hotcold."""
    if folder := os.environ.get("HOTCOLD_CACHE_DIR"):
        return Path(folder)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hotcold"


def cache_name(model_path: str | os.PathLike[str]) -> str:
    """A model's name in the user cache: its file name plus a digest of its absolute path (two models of one
    name in different folders keep their own caches)."""
    model = Path(model_path).resolve()
    return f"{model.name}.{hashlib.sha256(os.fsencode(model)).hexdigest()[:16]}"


def _package_dir() -> Path:
    import hotcold

    return Path(hotcold.__file__).resolve().parent


def writes_beside(model_path: str | os.PathLike[str]) -> bool:
    """A model's cache goes beside it unless its folder is inside the installed hotcold package (the bundled
    demo model: installing or upgrading would replace it, and it is not the user's folder) or not writable."""
    folder = Path(model_path).resolve().parent
    package = _package_dir()
    if folder == package or package in folder.parents:
        return False
    return os.access(folder, os.W_OK | os.X_OK)
