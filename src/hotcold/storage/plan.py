"""The RAM budget spent in order (`--ram-budget GIB`, `hotcold.load(ram_budget=...)`): first what every token
reads (attention matrices and norms, the KV cache, predictors, the output head, a forward's scratch), then the
hottest FFN neurons by the activation statistics (without them: in index order), then a cache of recently read
cold neurons; every other FFN row stays in the file and is read when the predictor selects it (storage/ffn.py).
The token embedding stays mapped from the file: a token reads one row of it, and the page cache may drop the rest.
The process's own memory (Python, torch) is reported beside the budget, not in it."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import numpy as np

from hotcold.config import ModelConfig
from hotcold.gguf import names
from hotcold.gguf.io import ModelFile
from hotcold.placement.scratch import scratch_parts
from hotcold.placement.walk import GIB, MIB, walk_costs

# of what is left after the always-read part, for the neuron cache (HOTCOLD_NEURON_CACHE_SHARE)
CACHE_SHARE = 0.1
# a forward gathers at most this share of a layer's neurons at once (StoredFFN's token groups)
GATHER_SHARE = 0.25


def process_rss() -> int | None:
    """This process's resident memory now (bytes), or None where /proc is not there."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def cache_share() -> float:
    value = os.environ.get("HOTCOLD_NEURON_CACHE_SHARE", "")
    if not value:
        return CACHE_SHARE
    try:
        share = float(value)
    except ValueError:
        share = -1.0
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"HOTCOLD_NEURON_CACHE_SHARE must be a number in [0, 1], got {value!r}")
    return share


@dataclass
class RamPlan:
    budget_bytes: int
    ctx_size: int
    always: dict[str, int]  # what every token reads, in the order it was charged
    per_neuron: list[int]  # per layer: one neuron's up, gate and down_t rows (+ its up bias)
    hot: list[np.ndarray]  # per layer: the resident neurons, sorted
    cache_slots: list[int]  # per layer: neurons the cache holds
    n_ff: list[int]
    statistics: str | None  # the activation statistics' folder, or None (neurons taken in index order)
    embedding_bytes: int = 0  # mapped from the file, not charged
    overhead_bytes: int | None = None  # the process before load (Python, torch), beside the budget
    notes: list[str] = field(default_factory=list)

    @property
    def always_bytes(self) -> int:
        return sum(self.always.values())

    @property
    def hot_bytes(self) -> int:
        return sum(len(h) * b for h, b in zip(self.hot, self.per_neuron))

    @property
    def cache_bytes(self) -> int:
        return sum(s * b for s, b in zip(self.cache_slots, self.per_neuron))

    @property
    def file_bytes(self) -> int:
        """FFN rows left in the file (read on demand)."""
        return sum((f - len(h)) * b for f, h, b in zip(self.n_ff, self.hot, self.per_neuron))

    @property
    def hot_share(self) -> float:
        total = sum(self.n_ff)
        return sum(len(h) for h in self.hot) / total if total else 0.0

    def as_dict(self) -> dict:
        return {
            "budget_bytes": self.budget_bytes,
            "ctx_size": self.ctx_size,
            "process_overhead_bytes": self.overhead_bytes,
            "always_read_bytes": dict(self.always),
            "hot_neurons": sum(len(h) for h in self.hot),
            "hot_share": self.hot_share,
            "hot_bytes": self.hot_bytes,
            "neuron_cache_neurons": sum(self.cache_slots),
            "neuron_cache_bytes": self.cache_bytes,
            "in_file_bytes": self.file_bytes,
            "embedding_mapped_bytes": self.embedding_bytes,
            "statistics": self.statistics,
            "planned_bytes": self.always_bytes + self.hot_bytes + self.cache_bytes,
        }

    def describe(self) -> str:
        always = ", ".join(f"{k} {v / MIB:.1f} MiB" for k, v in self.always.items())
        overhead = (
            ""
            if self.overhead_bytes is None
            else f"; process before load {self.overhead_bytes / GIB:.2f} GiB"
        )
        source = f"by the activation statistics in {self.statistics}" if self.statistics else "in index order"
        return (
            f"RAM budget {self.budget_bytes / GIB:.2f} GiB (the model's memory{overhead}, not in the budget): "
            f"every token reads {always}; hot FFN neurons {100 * self.hot_share:.1f}% "
            f"({sum(len(h) for h in self.hot)}, {self.hot_bytes / MIB:.1f} MiB, {source}); neuron cache "
            f"{sum(self.cache_slots)} neurons ({self.cache_bytes / MIB:.1f} MiB); {self.file_bytes / MIB:.1f} MiB "
            f"of FFN rows read from the file on demand; token embedding mapped ({self.embedding_bytes / MIB:.1f} MiB, "
            "a row a token)" + "".join(f"; {n}" for n in self.notes)
        )


def plan_ram(
    model_file: ModelFile, config: ModelConfig, budget_bytes: int, *, ctx_size: int, kv_sequences: int = 1,
    counts: list | None = None, statistics: str | None = None, share: float | None = None,
) -> RamPlan:  # fmt: skip
    """The plan for `budget_bytes`. counts: per layer the activation counts (None: neurons in index order);
    share: of what the always-read part leaves, for the neuron cache (None: cache_share()). ValueError naming
    what did not fit when the budget is below the always-read part."""
    if budget_bytes < 0:
        raise ValueError(f"ram_budget must be >= 0, got {budget_bytes / GIB:g} GiB")
    L = config.n_layer
    c = walk_costs(model_file, config, ctx_size=ctx_size, device_type="cpu", kv_sequences=kv_sequences)
    for i in range(L):
        if names.tensor(names.FFN_DOWN_T, i) not in model_file.tensors:
            raise ValueError(
                f"{model_file.path}: --ram-budget reads FFN rows on demand from PowerInfer's layout; layer {i} has no "
                f"{names.tensor(names.FFN_DOWN_T, i)} (a dense or MoE file: not supported yet)"
            )
    n_ff = [int(model_file.entry(names.tensor(names.FFN_UP, i)).shape[0]) for i in range(L)]
    parts = scratch_parts(config, ctx_size)
    compute = parts["residual"] + max(parts["attention"], parts["ffn"], parts["head"]) + parts["fixed"]
    always = {
        f"attention+norms of {L} layers": sum(c.layer) - L * c.kv,
        f"KV cache ({ctx_size} tokens x {kv_sequences})": L * c.kv,
        "predictors": sum(c.predictor),
        "output head": c.head,
        # a prompt chunk's temporaries, and the rows one layer gathers at once (a share of its neurons)
        "scratch (a prefill chunk, gathered rows)": compute
        + max(math.ceil(GATHER_SHARE * f) * b for f, b in zip(n_ff, c.per_neuron)),
    }
    spent, missed = 0, []
    for name, n in always.items():
        if spent + n > budget_bytes:
            missed.append(f"{name} ({n / MIB:.1f} MiB)")
        spent += n
    if missed:
        raise ValueError(
            f"--ram-budget {budget_bytes / GIB:.4g} GiB is below what every token reads, "
            f"{spent / MIB:.1f} MiB (" + ", ".join(f"{k} {v / MIB:.1f} MiB" for k, v in always.items())
            + "); did not fit: " + ", ".join(missed)
            + f". Give at least {spent / GIB:.4g} GiB, or a smaller -c/--ctx-size"
        )  # fmt: skip
    left = budget_bytes - spent
    share = cache_share() if share is None else share
    hot = _hot(counts, n_ff, c.per_neuron, left)
    if sum(len(h) for h in hot) < sum(n_ff):  # something stays in the file: keep a cache of what was read
        hot = _hot(counts, n_ff, c.per_neuron, int(left * (1 - share)))
        per_layer = (budget_bytes - spent - sum(len(h) * b for h, b in zip(hot, c.per_neuron))) // L
        slots = [min(f - len(h), per_layer // b) for f, h, b in zip(n_ff, hot, c.per_neuron)]
    else:
        slots = [0] * L
    embd = model_file.tensors.get(names.tensor(names.TOKEN_EMBD))
    return RamPlan(
        budget_bytes, ctx_size, always, list(c.per_neuron), hot, slots, n_ff,
        statistics if counts is not None else None, int(embd.n_bytes) if embd is not None else 0,
        notes=[] if counts is not None else ["no activation statistics beside the model: hot neurons in index order"],
    )  # fmt: skip


def _hot(counts, n_ff: list[int], per_neuron: list[int], budget: int) -> list[np.ndarray]:
    """Per layer the resident neurons (sorted) for `budget` bytes: with counts the most activated per byte across
    all layers (ties: lower layer, then lower index), else the first k neurons of every layer."""
    L = len(n_ff)
    if budget <= 0:
        return [np.zeros(0, dtype=np.int64) for _ in range(L)]
    if counts is None:
        k = budget // max(1, sum(per_neuron))
        return [np.arange(min(k, f), dtype=np.int64) for f in n_ff]
    score = np.concatenate([np.asarray(counts[i], dtype=np.float64) / per_neuron[i] for i in range(L)])
    layer = np.concatenate([np.full(f, i, dtype=np.int64) for i, f in enumerate(n_ff)])
    neuron = np.concatenate([np.arange(f, dtype=np.int64) for f in n_ff])
    order = np.lexsort((neuron, layer, -score))
    cost = np.cumsum(np.asarray(per_neuron, dtype=np.int64)[layer[order]])
    taken = order[: int(np.searchsorted(cost, budget, side="right"))]
    return [np.sort(neuron[taken[layer[taken] == i]]) for i in range(L)]
