"""A model file's tensors, each handed out shape-checked and already where the device plan puts it.

Families build their layers from a `TensorSource`; the parts every family shares are read here once: the
FFN weights of a layer (or of one expert), the predictor, the token embedding and the output head (tied to
the embedding when the file has no `output.weight`).
"""

from __future__ import annotations

import torch

from hotcold.config import ModelConfig
from hotcold.device import DevicePlan, place, place_vector
from hotcold.gguf import names
from hotcold.gguf.io import GGUFError, ModelFile
from hotcold.gguf.quants import QuantTensor
from hotcold.kernels import cpu
from hotcold.ops import Norm, Weight
from hotcold.sparse.ffn_weights import FFNWeights
from hotcold.sparse.predictor import Predictor


def weight_key(weight: Weight) -> tuple:
    """A matrix's identity by its memory (the expert slices a family makes are new objects over the file's pages)."""
    data = weight.data if isinstance(weight, QuantTensor) else weight
    return (data.data_ptr(), tuple(weight.shape))


def row_parts(t: Weight, rows: list[int]) -> list[Weight]:
    """A stored matrix that is several matrices one after another by rows, as those matrices (views: no copy)."""
    parts, start = [], 0
    cols = t.shape[1]
    for n in rows:
        parts.append(
            QuantTensor(t.data[start : start + n], t.qtype, (n, cols))
            if isinstance(t, QuantTensor)
            else t[start : start + n]
        )
        start += n
    return parts


class TensorSource:
    def __init__(
        self,
        model_file: ModelFile,
        config: ModelConfig,
        plan: DevicePlan,
        *,
        thresholded: bool = False,
        sparse_inputs=None,
        neuron_order: list[torch.Tensor | None] | None = None,
        ctx_size: int | None = None,
        packs: bool = True,
        storage=None,
    ):
        """thresholded: a `hotcold sparsify` file run thresholded (its FFN read from ffn_down_t, rows gathered, not
        packed); sparse_inputs: and with input-sparse attention, (attention_inputs.InputAssets, sparsity,
        threads); neuron_order: per layer, the FFN neurons hottest first (from the activation statistics), the
        order a sparse layer's rows are kept in so the rows a batch shares lie side by side (loader.neuron_order);
        packs: whether matrices multiplied whole get the C kernels' packed copies (`pack`; False where the weights
        do not fit in memory, loader.py); storage: the load's storage.model.ModelStorage under a RAM budget (an MoE
        file's experts are then read from the file: `experts`). Made whole here: nothing is set on a source after it
        is built."""
        self.file = model_file
        self.config = config
        self.plan = plan
        self.path = model_file.path
        self.thresholded = thresholded
        self.sparse_inputs = sparse_inputs
        self.neuron_order = neuron_order
        self.ctx_size = ctx_size  # the context the model is loaded for: it picks Phi-3's longrope factors
        self.packs = packs
        self.storage = storage
        # experts read from the file under a RAM budget are not packed here (storage/experts.py copies the resident)
        self.packs_experts = storage is None or storage.plan.unit != "expert"
        self.packed_experts: set[tuple] = (
            set()
        )  # weight_key of the expert matrices a load without storage packs

    def pack(self, weight: Weight) -> Weight:
        """A matrix only ever multiplied whole, in the C kernels' packed copy (cpu.pack: anonymous memory, its file
        pages dropped) where this load packs, else as stored (file pages the kernel may evict and read again)."""
        return cpu.pack(weight) if self.packs else weight

    def pack_expert(self, weight: Weight) -> Weight:
        """An expert's matrix multiplied whole: `pack`ed, unless its experts are read from storage (then noted, so
        the store packs it as this load would have: `packed_experts`)."""
        if self.packs_experts:
            return self.pack(weight)
        self.packed_experts.add(weight_key(weight))
        return weight

    def experts(self, layer: int, experts: list):
        """A mixture-of-experts layer's experts (FFNs) as this load keeps them: as they are, or under a RAM budget
        an ExpertStore (storage/experts.py) reading them from the file when the router picks them."""
        if self.packs_experts:
            return experts
        return self.storage.experts(layer, experts, packs=lambda w: weight_key(w) in self.packed_experts)

    def has(self, template: str, layer: int | None = None, suffix: str = "weight", *, expert=None) -> bool:
        return names.tensor(template, layer, suffix, expert=expert) in self.file.tensors

    def raw(self, template: str, layer: int | None, shape: tuple[int, ...], suffix="weight", *, expert=None):
        """The tensor as stored (zero-copy), on the CPU; a type that is no weight's is refused, named."""
        return self.file.weight(names.tensor(template, layer, suffix, expert=expert), shape)

    def layer_device(self, layer: int) -> torch.device:
        return self.plan.attention[layer]

    def attention(self, template: str, layer: int, shape: tuple[int, ...], suffix: str = "weight") -> Weight:
        """An attention matrix (or bias: any shape) of `layer`, on the layer's attention device."""
        t = self.raw(template, layer, shape, suffix)
        if len(shape) > 1:  # only ever multiplied whole: the C kernels' packed layout where there is one
            return self.pack(place(t, self.layer_device(layer)))
        return place_vector(t, self.layer_device(layer))

    def attention_split(self, template: str, layer: int, rows: list[int], cols: int) -> list[Weight]:
        """A stored matrix of `layer` that is several matrices one after another by rows (Falcon's attn_qkv: q, k,
        v), as those matrices, each on the layer's device and packed as `attention` packs one: a q/k/v group of
        three then runs in one call, in the one-call decode as layer by layer."""
        t = self.raw(template, layer, (sum(rows), cols))
        return [self.pack(place(part, self.layer_device(layer))) for part in row_parts(t, rows)]

    def rope_freqs(self) -> torch.Tensor | None:
        """The factors [rope_dim / 2] that divide each RoPE pair's frequency, float32 on the CPU, or None: the
        file's `rope_freqs` (Llama 3.1's scaling, as upstream llama.cpp's converter writes it), or Phi-3's
        longrope `rope_factors_long` / `rope_factors_short`, chosen as llama.cpp chooses them: long when the
        context the model is loaded for is past `rope.scaling.original_context_length`. Factors that are not
        finite and positive are refused, named."""
        c = self.config
        name = names.ROPE_FREQS
        if not self.has(name) and (self.has(names.ROPE_FACTORS_LONG) or self.has(names.ROPE_FACTORS_SHORT)):
            if c.rope_ctx_orig is None:
                raise GGUFError(
                    f"{self.path}: longrope factors without the metadata key "
                    f"{c.arch}.rope.scaling.original_context_length that chooses between them"
                )
            long = self.ctx_size is not None and self.ctx_size > c.rope_ctx_orig
            name = names.ROPE_FACTORS_LONG if long else names.ROPE_FACTORS_SHORT
        if not self.has(name):
            return None
        t = self.raw(name, None, (c.rope_dim // 2,))
        t = (cpu.dequantize_rows(t) if isinstance(t, QuantTensor) else t).float().reshape(-1)
        if not bool(torch.isfinite(t).all()) or not bool((t > 0).all()):
            raise GGUFError(
                f"{self.path}: tensor {names.tensor(name)} has factors that are not finite and > 0"
            )
        return t

    def norm(
        self, template: str, layer: int | None, *, rms: bool, bias: bool = False, width: int | None = None
    ) -> Norm:
        """A norm of `layer` (None: the output norm) on the device that computes it, over `width` values (None:
        the model's width; a head's for Qwen3's q/k norms)."""
        c = self.config
        n = c.n_embd if width is None else width
        device = self.plan.output if layer is None else self.layer_device(layer)
        weight = place_vector(self.raw(template, layer, (n,)), device)
        b = place_vector(self.raw(template, layer, (n,), "bias"), device) if bias else None
        return Norm(weight, c.norm_eps, b, rms)

    def ffn(self, layer: int, *, gated: bool, biases: bool = False, expert: int | None = None) -> FFNWeights:
        """The FFN matrices of `layer` (or of one expert stored as its own tensors), on the layer's FFN
        device. PowerInfer's layout has `ffn_down_t` [F, D] (row i = neuron i) where dense files have
        `ffn_down` [D, F]; the down bias keeps the name of whichever is there."""
        c, device = self.config, self.plan.ffn[layer]
        D, F = c.n_embd, c.n_ff

        # a dense file's FFN is only ever multiplied whole (no predictor gathers its rows): pack it
        whole = not c.sparse and not self.thresholded and expert is None

        def matrix(template, shape):
            w = place(self.raw(template, layer, shape, expert=expert), device)
            return self.pack(w) if whole else w

        if gated and not self.has(names.FFN_GATE, layer, expert=expert):  # Phi-3: ffn_up is [gate; up]
            if c.sparse or self.thresholded or expert is not None:
                raise GGUFError(
                    f"{self.path}: layer {layer}'s fused ffn_up [gate; up] is read in dense files only"
                )
            fused = self.raw(names.FFN_UP, layer, (2 * F, D))
            gate, up = (self.pack(place(w, device)) for w in row_parts(fused, [F, F]))
            return FFNWeights(
                up=up, gate=gate, down_t=None, down=matrix(names.FFN_DOWN, (D, F)), kind=c.ffn_kind,
                activation=c.ffn_activation,
            )  # fmt: skip

        # a sparsified dense file has both downs: ffn_down_t only where rows are gathered
        sparse_layout = self.has(names.FFN_DOWN_T, layer, expert=expert) and (
            c.sparse or self.thresholded or not self.has(names.FFN_DOWN, layer, expert=expert)
        )
        down = names.FFN_DOWN_T if sparse_layout else names.FFN_DOWN
        order = self._order(layer, expert, device) if sparse_layout else None

        def rows(template):  # a matrix whose row i is neuron i: kept in `order` where there is one
            w = matrix(template, (F, D))
            return w if order is None else cpu.rows_in_order(w, order)

        up_bias = place_vector(self.raw(names.FFN_UP, layer, (F,), "bias"), device) if biases else None
        return FFNWeights(
            up=rows(names.FFN_UP),
            gate=rows(names.FFN_GATE) if gated else None,
            down_t=rows(names.FFN_DOWN_T) if sparse_layout else None,
            down=None if sparse_layout else matrix(names.FFN_DOWN, (D, F)),
            up_bias=up_bias if up_bias is None or order is None else up_bias[order],
            down_bias=place_vector(self.raw(down, layer, (D,), "bias"), device) if biases else None,
            kind=c.ffn_kind,
            activation=c.ffn_activation,
            order=order,
        )

    def _order(self, layer: int, expert: int | None, device: torch.device) -> torch.Tensor | None:
        """The order a sparse layer's neurons are kept in (None: the file's): only a layer's own FFN (the
        statistics are per layer, not per expert) on the CPU, from unpacked rows."""
        if self.neuron_order is None or expert is not None or device.type != "cpu" or not self.config.sparse:
            return None
        return self.neuron_order[layer]

    def predictor(self, layer: int, *, expert: int | None = None) -> Predictor | None:
        """blk.N.fc1 [R, D] and blk.N.fc2 [F, R] (R free per layer but must agree), on the predictor's
        device; None for a dense file."""
        c = self.config
        if not c.sparse:
            return None
        fc1_name = names.tensor(names.PRED_FC1, layer, expert=expert)
        rank = self.file.entry(fc1_name).shape[0]
        device = self.plan.predictor[layer]
        # only ever multiplied whole: quantized predictors (the original's quantize makes them Q4_0) get the
        # packed layout's kernel, 2-3x the row kernel's speed on their short rows
        fc1 = self.pack(place(self.raw(names.PRED_FC1, layer, (rank, c.n_embd), expert=expert), device))
        fc2 = self.raw(names.PRED_FC2, layer, (c.n_ff, rank), expert=expert)
        order = self._order(layer, expert, self.plan.ffn[layer])
        if order is not None:  # row i predicts neuron i: the FFN's order (a copy, kept beside the packed one)
            fc2 = fc2[order] if isinstance(fc2, torch.Tensor) else fc2.select_rows(order)
        fc2 = self.pack(place(fc2, device))
        return Predictor(fc1, fc2, c.sparse_threshold)

    def token_embd(self) -> Weight:
        """The embedding, on the CPU (a step reads one row of it, any row: its pages are asked for ahead)."""
        return cpu.prefetch_pages(self.raw(names.TOKEN_EMBD, None, (self.config.n_vocab, self.config.n_embd)))

    def output(self) -> Weight:
        """The output head [V, D] on the output device: `output.weight`, or the tied embedding."""
        c = self.config
        tied = not self.has(names.OUTPUT)
        head = self.raw(names.TOKEN_EMBD if tied else names.OUTPUT, None, (c.n_vocab, c.n_embd))
        return self.pack(place(head, self.plan.output))

    def output_norm(self, *, rms: bool, bias: bool = False) -> Norm:
        return self.norm(names.OUTPUT_NORM, None, rms=rms, bias=bias)
