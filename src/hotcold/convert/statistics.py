"""What a requantized model's activation statistics become: `hotcold quantize` carries them beside its output.

Requantizing keeps every neuron where it was, so the input's `activation/activation_{i}.pt` describe the output
as well: they are copied to the output's folder (as one set, put in place right after the model:
hotcold.atomic.atomic_directory), unless that folder already holds statistics (another model's, or these: left
as they are) or is the input's own (shared). The placement cache (`.generated.gpuidx`) is not carried: the
bytes per neuron, and so the hot set a budget buys, depend on the tensor types; the loader or `hotcold place`
solves it again for the output.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from hotcold.atomic import OutputError
from hotcold.placement.profile import check_activation_dir, default_activation_dir, read_activation_files

CARRY, SHARED, PRESENT, KEPT, REFUSED, NONE = "carry", "shared", "present", "kept", "refused", "none"


@dataclass(frozen=True)
class StatisticsPlan:
    action: str  # one of CARRY, SHARED, PRESENT, KEPT, REFUSED, NONE
    source: Path  # the input's statistics folder
    target: Path  # the output's
    files: tuple[Path, ...] = ()  # what CARRY copies
    reason: str = ""  # why not, for REFUSED
    had_gpuidx: bool = False  # the input had a placement cache beside it (not carried)

    def describe(self) -> list[str]:
        """Lines for people: what happened to the statistics and the placement cache."""
        lines = {
            CARRY: [f"carried the activation statistics of {self.source} to {self.target}"],
            SHARED: [f"the activation statistics in {self.source} serve the output too (same folder)"],
            PRESENT: [f"the activation statistics in {self.target} are already the input's"],
            KEPT: [
                f"activation statistics not carried: {self.target} already holds others (left as they are; "
                f"copy {self.source} there if the output should use the input's)"
            ],
            REFUSED: [f"activation statistics not carried: {self.reason}"],
            NONE: [],
        }[self.action]
        if self.had_gpuidx:
            lines.append(
                "the placement cache (.generated.gpuidx) is not carried: it depends on the tensor types; the "
                "first load with a VRAM budget (or `hotcold place`) solves it for the output"
            )
        return lines

    def copy_into(self, staging: Path) -> None:
        for file in self.files:
            shutil.copyfile(file, staging / file.name)


def _same_files(a: list[Path], folder: Path) -> bool:
    theirs = sorted(folder.glob("activation_*.pt"))
    return [p.name for p in a] == [p.name for p in theirs] and all(
        x.read_bytes() == y.read_bytes() for x, y in zip(a, theirs, strict=True)
    )


def plan_statistics(src: Path, dst: Path, *, n_layer: int, n_ff: int) -> StatisticsPlan:
    """What quantize does with src's statistics when it writes dst (nothing is written here)."""
    from hotcold.gguf.io import GGUFError
    from hotcold.placement.gpuidx import gpuidx_candidates

    source, target = default_activation_dir(src), default_activation_dir(dst)
    had_gpuidx = any(p.exists() for p in gpuidx_candidates(src))
    files = sorted(source.glob("activation_*.pt")) if source.is_dir() else []
    if not files:
        return StatisticsPlan(NONE, source, target, had_gpuidx=had_gpuidx)
    if target.resolve() == source.resolve():
        return StatisticsPlan(SHARED, source, target, had_gpuidx=had_gpuidx)
    if target.is_dir() and any(target.glob("activation_*.pt")):
        action = PRESENT if _same_files(files, target) else KEPT
        return StatisticsPlan(action, source, target, had_gpuidx=had_gpuidx)
    try:
        read_activation_files(source, n_layer, n_ff)  # a torn or foreign set is named, not copied
        check_activation_dir(target, [src, dst])
    except (GGUFError, OutputError) as exc:
        return StatisticsPlan(REFUSED, source, target, reason=str(exc), had_gpuidx=had_gpuidx)
    layers = tuple(source / f"activation_{i}.pt" for i in range(n_layer))
    return StatisticsPlan(CARRY, source, target, layers, had_gpuidx=had_gpuidx)
