"""A model's storage under a RAM budget, opened at load (loader.py): the plan, the file's reader, the counters,
and each layer's store of rows, made when the family asks for that layer's FFN."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from hotcold.config import ModelConfig
from hotcold.gguf import names
from hotcold.gguf.io import GGUFError, ModelFile
from hotcold.placement.walk import GIB
from hotcold.sparse.ffn import SparseFFN
from hotcold.sparse.ffn_weights import FFNWeights
from hotcold.storage.experts import ExpertStore, expert_fields
from hotcold.storage.ffn import LayerStore, StorageStats, StoredFFN, StoredMatrix
from hotcold.storage.plan import EXPERT_MATRICES, RamPlan, plan_ram
from hotcold.storage.reader import RowReader, misaligned, tensor_offset

log = logging.getLogger(__name__)


def activation_counts(path: Path, config: ModelConfig, notes: list[str]) -> tuple[list | None, str | None]:
    """(per-layer activation counts, their folder), or (None, None) without statistics (unreadable ones noted)."""
    from hotcold.placement.profile import default_activation_dir, read_activation_files

    folder = default_activation_dir(path)
    try:
        counts = read_activation_files(folder, config.n_layer, config.n_expert or config.n_ff)
    except GGUFError as exc:
        notes.append(f"--ram-budget: hot neurons in index order, the statistics are unreadable: {exc}")
        return None, None
    return (None, None) if counts is None else ([c.float().numpy() for c in counts], str(folder))


def ram_plan(path: Path, model_file: ModelFile, config: ModelConfig, budget_gib: float, *, ctx_size: int,
             kv_sequences: int = 1, overhead: int | None = None, notes: list[str] | None = None) -> RamPlan:  # fmt: skip
    """The plan for a budget in GiB (hotcold info --ram-budget, and the load)."""
    counts, folder = activation_counts(path, config, notes if notes is not None else [])
    plan = plan_ram(
        model_file, config, int(budget_gib * GIB), ctx_size=ctx_size, kv_sequences=kv_sequences, counts=counts,
        statistics=folder,
    )  # fmt: skip
    plan.overhead_bytes = overhead
    ffn = [names.tensor(t, 0) for t in (names.FFN_UP, names.FFN_GATE, names.FFN_DOWN_T, *EXPERT_MATRICES)]
    ffn = [n for n in ffn if n in model_file.tensors]
    offsets = [tensor_offset(model_file, n)[1] for n in ffn]
    row_bytes = [model_file.tensors[n].n_bytes // model_file.tensors[n].shape[0] for n in ffn]
    if misaligned(offsets, row_bytes):
        plan.notes.append(
            "the FFN rows start off page boundaries, so each costs two page reads: `python -m hotcold.storage.align "
            "IN OUT` writes the file page-aligned"
        )
    return plan


class ModelStorage:
    """The reader of the model file and the stats shared by every stored layer; `ffn(...)` makes a layer's FFN."""

    def __init__(self, model_file: ModelFile, plan: RamPlan, *, reader: RowReader | None = None):
        self.file, self.plan = model_file, plan
        self.stats = StorageStats()
        self.counting_layer: int | None = None  # the first stored layer: it counts the tokens
        first = names.FFN_UP_EXPS if plan.unit == "expert" else names.FFN_UP
        path = tensor_offset(model_file, names.tensor(first, 0))[0]
        self.reader = reader or RowReader(path)

    def experts(self, layer: int, experts: list, *, packs):
        """An MoE layer's experts (FFNs over the file's pages) as the plan keeps them: an ExpertStore (resident,
        cached, read on demand), or where every expert is resident the experts copied out of the file's pages.
        packs(weight): whether a load without storage packs that expert matrix (the family's decision)."""
        matrices = []
        for e, expert in enumerate(experts):
            row = []
            for template, name in zip(EXPERT_MATRICES, expert_fields(expert)):
                where, offset = tensor_offset(self.file, names.tensor(template, layer))
                if where != self.reader.path:
                    raise GGUFError(
                        f"{self.file.path}: tensor {names.tensor(template, layer)} is in {where}: --ram-budget reads "
                        "one-file models"
                    )
                m = StoredMatrix(names.tensor(template, layer), offset, getattr(expert.weights, name))
                m.offset += e * m.rows * m.row_bytes  # expert e's slice of the stacked tensor
                row.append(m)
            matrices.append(row)
        if self.counting_layer is None:  # layers are made in order: the lowest counts the tokens
            self.counting_layer = layer
        store = ExpertStore(self.reader, layer, list(experts), matrices, self.plan.hot[layer],
                            self.plan.cache_slots[layer], self.stats, packs=packs,
                            counts_tokens=self.counting_layer == layer)  # fmt: skip
        if len(store.resident) == len(store):
            return [store.resident[e] for e in range(len(store))]  # an ordinary MoE layer, in memory
        return store

    def ffn(
        self, layer: int, weights: FFNWeights, predictor, norm, *, threads: int | None
    ) -> StoredFFN | SparseFFN:
        if weights.order is not None:
            raise ValueError(
                "--ram-budget reads rows in the file's order: a reordered layer cannot be stored"
            )
        templates = (
            [names.FFN_UP] + ([names.FFN_GATE] if weights.gate is not None else []) + [names.FFN_DOWN_T]
        )
        mats = [weights.up] + ([weights.gate] if weights.gate is not None else []) + [weights.down_t]
        matrices = []
        for template, w in zip(templates, mats):
            name = names.tensor(template, layer)
            where, offset = tensor_offset(self.file, name)
            if where != self.reader.path:
                raise GGUFError(
                    f"{self.file.path}: tensor {name} is in {where}: --ram-budget reads one-file models"
                )
            matrices.append(StoredMatrix(name, offset, w))
        store = LayerStore(
            self.reader, matrices, self.plan.hot[layer], self.plan.cache_slots[layer], self.stats
        )
        if len(store.hot) == matrices[0].rows:
            # every neuron resident: the resident rows are the whole matrices in order, so the layer is an ordinary
            # sparse layer over them (its one-call plans, and the one-call decode where every layer is so)
            up, gate, down_t = (
                (m.weight(b) for m, b in zip(matrices, store.hot_rows))
                if len(matrices) == 3
                else (matrices[0].weight(store.hot_rows[0]), None, matrices[1].weight(store.hot_rows[1]))
            )
            resident = replace(weights, up=up, gate=gate, down_t=down_t)
            return SparseFFN(resident, predictor, layer=layer, norm=norm, threads=threads)
        if self.counting_layer is None:  # layers are made in order: the lowest stored one counts tokens
            self.counting_layer = layer
        counts = self.counting_layer == layer
        return StoredFFN(
            weights, predictor, store, layer=layer, norm=norm, threads=threads, counts_tokens=counts
        )

    def close(self) -> None:
        self.reader.close()


def open_storage(path: Path, model_file: ModelFile, config: ModelConfig, *, budget_gib: float | None, ctx: int,
                 kv_sequences: int, on_gpu: bool, sparse: bool, overhead: int | None,
                 notes: list[str]) -> ModelStorage | None:  # fmt: skip
    """The storage of a model loaded with a RAM budget (None without one). Refused, saying why: a GPU in use
    (hot rows there and a RAM budget together are not built yet), a run that is not sparse (dense files, --dense,
    `hotcold sparsify` files: there is no predictor's mask to read rows by)."""
    if budget_gib is None:
        return None
    if on_gpu:
        raise ValueError("--ram-budget runs on the CPU for now: give --device cpu (or --vram-budget 0)")
    if not sparse and names.tensor(names.FFN_UP_EXPS, 0) not in model_file.tensors:
        raise ValueError(
            f"{path}: --ram-budget reads the FFN rows a predictor selects: it needs a sparse PowerInfer file run "
            "sparsely (not a dense file, not --dense, not a `hotcold sparsify` file)"
        )
    plan = ram_plan(path, model_file, config, budget_gib, ctx_size=ctx, kv_sequences=kv_sequences,
                    overhead=overhead, notes=notes)  # fmt: skip
    notes.append(plan.describe())
    log.info("%s", plan.describe())
    return ModelStorage(model_file, plan)
