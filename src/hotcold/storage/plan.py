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
from hotcold.placement.walk import GIB, MIB, output_tensors, placed_sizes, walk_costs

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
    unit: str = "neuron"  # what `hot` and `cache_slots` count: FFN neurons, or experts (an MoE file)
    slot_bytes: list[int] | None = (
        None  # per layer a cache slot's bytes where not per_neuron's (experts' slots)
    )
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
        return sum(s * b for s, b in zip(self.cache_slots, self.slot_bytes or self.per_neuron))

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
            "unit": self.unit,
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
        if self.unit == "expert" and not self.statistics:
            source = "all or none: no routing statistics"
        elif self.unit == "expert":
            source = f"the most routed, by the statistics in {self.statistics}"
        unit, what = self.unit, "FFN rows" if self.unit == "neuron" else "experts"
        resident = "hot FFN neurons" if self.unit == "neuron" else "resident experts"
        return (
            f"RAM budget {self.budget_bytes / GIB:.2f} GiB (the model's memory{overhead}, not in the budget): "
            f"every token reads {always}; {resident} {100 * self.hot_share:.1f}% "
            f"({sum(len(h) for h in self.hot)}, {self.hot_bytes / MIB:.1f} MiB, {source}); {unit} cache "
            f"{sum(self.cache_slots)} {unit}s ({self.cache_bytes / MIB:.1f} MiB); {self.file_bytes / MIB:.1f} MiB "
            f"of {what} read from the file on demand; token embedding mapped ({self.embedding_bytes / MIB:.1f} MiB, "
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
    if names.tensor(names.FFN_UP_EXPS, 0) in model_file.tensors:
        return _plan_experts(model_file, config, budget_bytes, c, ctx_size=ctx_size, kv_sequences=kv_sequences,
                             counts=counts, statistics=statistics, share=share)  # fmt: skip
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
    left = budget_bytes - _charge(always, budget_bytes)
    share = cache_share() if share is None else share
    hot = _hot(counts, n_ff, c.per_neuron, left)
    if sum(len(h) for h in hot) < sum(n_ff):  # something stays in the file: keep a cache of what was read
        hot = _hot(counts, n_ff, c.per_neuron, int(left * (1 - share)))
        per_layer = (left - sum(len(h) * b for h, b in zip(hot, c.per_neuron))) // L
        slots = [min(f - len(h), per_layer // b) for f, h, b in zip(n_ff, hot, c.per_neuron)]
    else:
        slots = [0] * L
    embd = model_file.tensors.get(names.tensor(names.TOKEN_EMBD))
    return RamPlan(
        budget_bytes, ctx_size, always, list(c.per_neuron), hot, slots, n_ff,
        statistics if counts is not None else None, int(embd.n_bytes) if embd is not None else 0,
        notes=[] if counts is not None else ["no activation statistics beside the model: hot neurons in index order"],
    )  # fmt: skip


def _charge(always: dict[str, int], budget_bytes: int) -> int:
    """The bytes of what every token reads, or ValueError naming what did not fit in the budget."""
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
    return spent


EXPERT_MATRICES = (names.FFN_UP_EXPS, names.FFN_GATE_EXPS, names.FFN_DOWN_EXPS)
# a cached expert's slot against the expert's file bytes: the bytes as read and their packed copies (at most 3% more
# than the rows: Q4_K's packed form; F16's pads its last block of rows)
SLOT_COST = 2.05
RESIDENT_COST = 1.03  # a resident expert: its packed copies (Q4_K's 3% larger than its rows), or its rows


def _plan_experts(model_file: ModelFile, config: ModelConfig, budget_bytes: int, c, *, ctx_size: int,
                  kv_sequences: int, counts=None, statistics: str | None = None, share: float | None = None,
                  ) -> RamPlan:  # fmt: skip
    """An MoE file's plan: every tensor but the stacked expert matrices (and the embedding) always read, then whole
    experts: all resident where they fit, else a cache of experts in each layer (at least the router's top-k, so a
    token's experts are in memory together) and, with routing counts (`hotcold profile`), the most routed experts
    per byte resident in what the cache leaves (CACHE_SHARE of it to the cache); every other expert read from the
    file when the router picks it."""
    L, E, k = config.n_layer, config.n_expert, config.n_expert_used
    stacked = {names.tensor(t, i) for t in EXPERT_MATRICES for i in range(L)}
    if len(stacked & set(model_file.tensors)) != len(stacked):
        missing = sorted(stacked - set(model_file.tensors))[0]
        raise ValueError(
            f"{model_file.path}: --ram-budget reads stacked experts; tensor {missing} is missing"
        )
    per_expert = [
        sum(model_file.tensors[names.tensor(t, i)].n_bytes for t in EXPERT_MATRICES) // E for i in range(L)
    ]
    sizes = placed_sizes(model_file, "cpu")
    head = set(output_tensors(model_file))
    layers = sum(n for name, n in sizes.items() if names.block_of(name) is not None and name not in stacked)
    parts = scratch_parts(config, ctx_size)
    always = {
        f"attention, norms, routers and expert biases of {L} layers": layers,
        f"KV cache ({ctx_size} tokens x {kv_sequences})": L * c.kv,
        "output head": sum(sizes[n] for n in head),
        "scratch (a prefill chunk)": parts["residual"] + max(parts["attention"], parts["ffn"], parts["head"])
        + parts["fixed"],
    }  # fmt: skip
    left = budget_bytes - _charge(always, budget_bytes)
    notes = []
    if left >= RESIDENT_COST * sum(per_expert) * E:
        hot, slots = [np.arange(E, dtype=np.int64) for _ in range(L)], [0] * L
    else:
        hot = [np.zeros(0, dtype=np.int64) for _ in range(L)]
        # a cache slot holds an expert as read and the packed copies of its matrices (storage/experts.py)
        slot = [SLOT_COST * b for b in per_expert]
        spare = left - k * sum(slot)  # after each layer's top-k slots
        if counts is not None and spare > 0:
            share = cache_share() if share is None else share
            hot = _hot(
                counts, [E] * L, [int(RESIDENT_COST * b) for b in per_expert], int(spare * (1 - share))
            )
            spare -= sum(len(h) * RESIDENT_COST * b for h, b in zip(hot, per_expert))
        extra = spare / L  # the rest shared in bytes
        slots = [0 if len(h) == E else min(E - len(h), k + int(extra // b)) for h, b in zip(hot, slot)]
        if extra < 0:
            need = sum(always.values()) + k * sum(slot)
            raise ValueError(
                f"--ram-budget {budget_bytes / GIB:.4g} GiB leaves room for {int(left / L // max(slot))} experts a layer; a token "
                f"needs its {k} in memory together: give at least {math.ceil(need / MIB)} MiB, or a smaller -c/--ctx-size"
            )
        if counts is None:
            notes.append(
                "no routing statistics (`hotcold profile`): the experts' cache keeps the router's last picks"
            )
    embd = model_file.tensors.get(names.tensor(names.TOKEN_EMBD))
    return RamPlan(
        budget_bytes, ctx_size, always, per_expert, hot, slots, [E] * L, statistics if counts is not None else None,
        int(embd.n_bytes) if embd is not None else 0, notes=notes, unit="expert",
        slot_bytes=[int(SLOT_COST * b) for b in per_expert],
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
