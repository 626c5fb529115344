"""The FFN steps as single C calls on the CPU: the sparse step (`SparseFFNPlan`: predictor, row gathers,
activation, axpy), the thresholded SwiGLU step of sparsified files (`ThresholdedPlan`), a dense decode layer's
tail (`DenseTail`) and the FFN activation itself (`ffn_combine`), each with the bits of `cpu`'s ops called one
by one."""

from __future__ import annotations

import ctypes

import torch

from hotcold.kernels import build
from hotcold.kernels.build import as_mask, as_tokens, hc_weight, nthreads, ptr
from hotcold.kernels.cpu import Weight, gather_matvec, norm_weight, rms_norm, sparse_axpy

__all__ = ["SparseFFNPlan", "ThresholdedPlan", "DenseTail", "ffn_combine"]

FFN_KINDS = {"gated": 0, "gated_both": 1, "plain": 2}  # the C kernels' kind codes


def tail_io(attn: torch.Tensor, x: torch.Tensor, attn_cols: int, d: int, norm: tuple[torch.Tensor, float]):
    """A decode tail's inputs checked (attn [T, attn_cols], x [T, D], the same T) and its outputs allocated:
    (attn, x as [T, n] float32, norm weight, eps, y1, y2 [T, D])."""
    a2, _ = as_tokens(attn, attn_cols, "attn")
    x2, _ = as_tokens(x, d, "x")
    t = x2.shape[0]
    if a2.shape[0] != t:
        raise ValueError(f"attn has {a2.shape[0]} tokens, x has {t}")
    norm_w, eps = norm_weight(norm, d)
    return a2, x2, norm_w, eps, torch.empty(t, d, dtype=torch.float32), torch.empty(t, d, dtype=torch.float32)


class _LayerTail:
    """A plan's decode tail: the rest of a layer after attention in one C call (`_tail_fn`, taking wo, attn, x,
    the plan's own arguments, T, the norm, mask, y1, y2, threads). The attention output matrix's struct is
    built once per layer (a plan serves one layer)."""

    f: int
    d: int
    _tail_fn: str
    _wo: Weight | None = None
    _wo_struct = None

    def _tail_ffn_args(self) -> tuple | None:
        """The plan's own arguments of `_tail_fn`, or None where it has no tail."""
        raise NotImplementedError

    def tail(
        self,
        wo: Weight,
        attn: torch.Tensor,
        x: torch.Tensor,
        *,
        norm: tuple[torch.Tensor, float],
        threads=None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None:
        """y1 = x + matmul(wo, attn) (the residual, also a predictor's input), y2 = y1 + this plan's step on y1
        with the RMS norm folded -> (y1, y2, mask, computed count); the same bits as those calls and adds one
        by one, for a wo that `matmul` multiplies in C (`ops.uses_c_kernels`: the caller checks). None
        without the C kernels or where the plan has no tail."""
        lib = build.get_lib()
        ffn = None if lib is None else self._tail_ffn_args()
        if ffn is None:
            return None
        wo_ref, a2, x2, norm_w, eps, y1, y2, mask = self._tail_io(wo, attn, x, norm)
        n = getattr(lib, self._tail_fn)(
            wo_ref, a2.data_ptr(), x2.data_ptr(), *ffn, x2.shape[0], ptr(norm_w), eps, mask.data_ptr(),
            y1.data_ptr(), y2.data_ptr(), nthreads(threads),
        )  # fmt: skip
        if n < 0:
            raise MemoryError(f"{self._tail_fn}: out of memory")
        return y1, y2, mask, int(n)

    def _tail_io(self, wo: Weight, attn: torch.Tensor, x: torch.Tensor, norm: tuple[torch.Tensor, float]):
        """(wo struct reference, attn, x as [T, n] float32, norm weight, eps, y1, y2 [T, D], mask [T, F])."""
        if self._wo is not wo:
            self._wo, self._wo_struct = wo, hc_weight(wo)
        if self._wo_struct.rows != self.d:
            raise ValueError(f"wo has {self._wo_struct.rows} rows, the FFN takes {self.d}")
        a2, x2, norm_w, eps, y1, y2 = tail_io(attn, x, self._wo_struct.cols, self.d, norm)
        mask = torch.empty(x2.shape[0], self.f, dtype=torch.bool)
        return ctypes.byref(self._wo_struct), a2, x2, norm_w, eps, y1, y2, mask


class SparseFFNPlan(_LayerTail):
    """One ReLU sparse FFN step: the predictor (fc1/fc2 on pred_input, firing iff the logit >= threshold)
    or a given bool mask, the row gathers (gate first; up only where relu(gate) != 0), the activation (with
    v = up + up_bias: relu(gate) * v, relu(gate) * relu(v), or relu(v) for "plain") and the axpy over
    down_t, in one C call (without the C kernels: the same steps in this module's ops). Equal bit for bit
    to gather_matvec / sparse_axpy called one by one. Shapes are checked and the C argument structs built
    once (ValueError for weights it cannot take); the plan keeps its weights alive."""

    def __init__(
        self,
        up: Weight,
        gate: Weight | None,
        down_t: Weight,
        *,
        kind: str = "gated",
        up_bias: torch.Tensor | None = None,
        fc1: Weight | None = None,
        fc2: Weight | None = None,
        threshold: float = 0.0,
    ):
        if (fc1 is None) != (fc2 is None):
            raise ValueError("a predictor needs both fc1 and fc2")
        if kind not in FFN_KINDS:
            raise ValueError(f"unknown FFN kind {kind!r}; expected one of {tuple(FFN_KINDS)}")
        if gate is None and kind != "plain":
            raise ValueError(f"a {kind!r} FFN needs a gate")
        self.weights = (up, gate, down_t, fc1, fc2)  # kept alive: the structs point into them
        self.up, self.gate, self.down_t = hc_weight(up), hc_weight(gate), hc_weight(down_t)
        self.fc1, self.fc2 = hc_weight(fc1), hc_weight(fc2)
        self.f, self.d = self.up.rows, self.up.cols
        f, d = self.f, self.d
        checks = [("gate", self.gate, (f, d)), ("down_t", self.down_t, (f, d))]
        if self.fc1 is not None:
            checks += [("fc1", self.fc1, (self.fc1.rows, d)), ("fc2", self.fc2, (f, self.fc1.rows))]
        for name, w, shape in checks:
            if w is not None and (w.rows, w.cols) != shape:
                raise ValueError(f"{name} has shape {(w.rows, w.cols)}, expected {shape}")
        self.bias = None
        if up_bias is not None:
            self.bias = up_bias.to(torch.float32).contiguous()
            if self.bias.shape != (f,):
                raise ValueError(f"up_bias has shape {tuple(self.bias.shape)}, expected [{f}]")
        self.kind = FFN_KINDS[kind]
        self.threshold = threshold
        structs = (self.fc1, self.fc2, self.up, self.gate, self.down_t)
        self._args = tuple(None if w is None else ctypes.byref(w) for w in structs)

    def __call__(
        self,
        x: torch.Tensor,
        pred_input: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
        *,
        norm: tuple[torch.Tensor, float] | None = None,
        threads: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """x, pred_input [T, D] float32 (or a mask `rows` [T, F] when the plan has no predictor) ->
        (out [T, D], mask [T, F] bool, firing count). With norm = (weight, eps) the FFN input is
        rms_norm(x) (as `rms_norm` computes it), pred_input as given."""
        x2, _ = as_tokens(x, self.d, "x")
        t = x2.shape[0]
        if (self.fc1 is None) == (rows is None):
            raise ValueError("give a rows mask exactly when the plan has no predictor")
        p2 = None
        if rows is not None:
            mask = as_mask(rows, t, self.f).clone()
        else:
            mask = torch.empty(t, self.f, dtype=torch.bool)
            p2, _ = as_tokens(pred_input, self.d, "pred_input")
            if p2.shape[0] != t:
                raise ValueError(f"pred_input has {p2.shape[0]} tokens, x has {t}")
        norm_w, eps = norm_weight(norm, self.d)
        lib = build.get_lib()
        if lib is None:
            return self._torch_step(x2, p2, mask, norm_w, eps, threads)
        out = torch.empty(t, self.d, dtype=torch.float32)
        fc1, fc2, up, gate, down_t = self._args
        head = (fc1, fc2, self.threshold, ptr(p2), up, gate, down_t, ptr(self.bias), self.kind, t)
        tail = (x2.data_ptr(), ptr(norm_w), eps, mask.data_ptr(), out.data_ptr(), nthreads(threads))
        fired = lib.hc_sparse_ffn(*head, *tail)
        if fired < 0:
            raise MemoryError("hc_sparse_ffn: out of memory")
        return out, mask, int(fired)

    _tail_fn = "hc_decode_tail"

    def _tail_ffn_args(self) -> tuple | None:
        """The tail (`_LayerTail.tail`) needs the predictor: its output is the mask."""
        if self.fc1 is None:
            return None
        fc1, fc2, up, gate, down_t = self._args
        return fc1, fc2, self.threshold, up, gate, down_t, ptr(self.bias), self.kind

    def _torch_step(self, x, p, mask, norm_w, eps, threads) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The C step's arithmetic in this module's ops (the torch fallback)."""
        up, gate, down_t, fc1, fc2 = self.weights
        if norm_w is not None:
            x = rms_norm(x, norm_w, eps)
        if fc1 is not None:
            h = torch.relu(gather_matvec(fc1, p, None, threads=threads))
            logits = gather_matvec(fc2, h, None, threads=threads)
            mask = logits >= torch.tensor(self.threshold, dtype=torch.float32)
        live, g = mask, None
        if gate is not None:
            g = torch.relu(gather_matvec(gate, x, mask, threads=threads))
            live = mask & (g != 0)  # NaN stays alive, as in C
        v = gather_matvec(up, x, live, threads=threads)
        v = v if self.bias is None else v + self.bias
        a = g * v if self.kind == 0 else g * torch.relu(v) if self.kind == 1 else torch.relu(v)
        a = torch.where(live, a, torch.zeros(()))
        return sparse_axpy(down_t, a, live, threads=threads), mask, int(mask.sum())


C_ACTIVATIONS = {"relu": 0, "silu": 1, "gelu": 2, "gelu_tanh": 3}  # the C kernels' activation codes
COMBINE_KINDS = {**FFN_KINDS, "swiglu_oai": 3}  # hc_ffn_combine's (and the one-call MoE tail's) kinds


def ffn_combine(
    kind: str,
    activation: str,
    up: torch.Tensor,
    gate: torch.Tensor | None,
    up_bias: torch.Tensor | None,
    gate_bias: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The FFN activation (FFNWeights.combine) of CPU float32 up / gate [..., F] in one C call: v = up (+
    up_bias), then act(gate) * v, act(gate) * act(v) or act(v) for kind gated / gated_both / plain. relu
    gives torch's bits; silu is the C kernels' x / (1 + exp(-x)) (torch's own exp differs between its SIMD
    builds), the one SiLU of every CPU path (dense_tail's included), so a row's bits never depend on its
    path; gelu likewise the C kernels' erf form, x * 0.5 * (1 + erf(x / sqrt(2))). Kind swiglu_oai: gpt-oss's
    clamped SwiGLU of gate (+ gate_bias) and up (+ up_bias), the C kernels' exp (sparse/ffn_weights.swiglu_oai).
    None where the call does not apply (no C kernels, another activation or device): use torch."""
    lib = build.get_lib()
    if lib is None or activation not in C_ACTIVATIONS or kind not in COMBINE_KINDS:
        return None
    if gate_bias is not None and (kind != "swiglu_oai" or gate_bias.shape != (up.shape[-1],)):
        return None
    tensors = [t for t in (up, gate, up_bias, gate_bias) if t is not None]
    if any(t.device.type != "cpu" or t.dtype != torch.float32 for t in tensors):
        return None
    f = up.shape[-1]
    if (gate is None) != (kind == "plain") or (gate is not None and gate.shape != up.shape):
        return None
    if up_bias is not None and up_bias.shape != (f,):
        return None
    u, g = up.contiguous(), None if gate is None else gate.contiguous()
    b = None if up_bias is None else up_bias.contiguous()
    gb = None if gate_bias is None else gate_bias.contiguous()
    out = torch.empty_like(u)
    t = u.numel() // f if f else 0
    lib.hc_ffn_combine(
        COMBINE_KINDS[kind], C_ACTIVATIONS[activation], u.data_ptr(), ptr(g), ptr(b), ptr(gb), t, f,
        out.data_ptr(), nthreads(None),
    )  # fmt: skip
    return out


class DenseTail:
    """The rest of a dense decode layer after attention in one C call (`hc_dense_tail`): y1 = x + matmul(wo,
    attn), y2 = y1 + the FFN of rms_norm(y1): up / gate as one LinearGroup call, ffn_combine, then down
    [D, F] (matmul) or the axpy over down_t [F, D]; the same bits as those ops one by one. For weights that
    `matmul` multiplies in C (the caller checks `ops.uses_c_kernels` and the token count); ValueError for
    shapes or kinds it cannot take. Keeps its weights alive."""

    def __init__(self, wo: Weight, up: Weight, gate: Weight | None, down: Weight, *, down_is_t: bool, kind: str,
                 activation: str, up_bias: torch.Tensor | None = None):  # fmt: skip
        if kind not in FFN_KINDS or activation not in C_ACTIVATIONS:
            raise ValueError(f"no C dense tail for a {kind!r} FFN with {activation!r}")
        if (gate is None) != (kind == "plain"):
            raise ValueError(f"a {kind!r} FFN {'needs' if gate is None else 'has no'} gate")
        self.weights = (wo, up, gate, down)  # kept alive: the structs point into them
        self.wo, self.up, self.gate, self.down = (hc_weight(w) for w in self.weights)
        self.d, self.f = self.wo.rows, self.up.rows
        down_shape = (self.f, self.d) if down_is_t else (self.d, self.f)
        checks = [("up", self.up, (self.f, self.d)), ("gate", self.gate, (self.f, self.d))]
        for name, w, shape in checks + [("down_t" if down_is_t else "down", self.down, down_shape)]:
            if w is not None and (w.rows, w.cols) != shape:
                raise ValueError(f"{name} has shape {(w.rows, w.cols)}, expected {shape}")
        self.bias = None if up_bias is None else up_bias.to(torch.float32).contiguous()
        if self.bias is not None and self.bias.shape != (self.f,):
            raise ValueError(f"up_bias has shape {tuple(self.bias.shape)}, expected [{self.f}]")
        self.down_is_t = down_is_t
        self.kind, self.act = FFN_KINDS[kind], C_ACTIVATIONS[activation]
        structs = (self.wo, self.up, self.gate, self.down)
        self._args = tuple(None if w is None else ctypes.byref(w) for w in structs)

    def __call__(
        self, attn: torch.Tensor, x: torch.Tensor, *, norm: tuple[torch.Tensor, float], threads=None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(y1, y2) [T, D] for attn [T, H*Dh] and x [T, D]; None without the C kernels."""
        lib = build.get_lib()
        if lib is None:
            return None
        a2, x2, norm_w, eps, y1, y2 = tail_io(attn, x, self.wo.cols, self.d, norm)
        t = x2.shape[0]
        wo, up, gate, down = self._args
        ffn = (up, gate, down, int(self.down_is_t), ptr(self.bias), self.kind, self.act, t, ptr(norm_w), eps)
        rc = lib.hc_dense_tail(
            wo, a2.data_ptr(), x2.data_ptr(), *ffn, y1.data_ptr(), y2.data_ptr(), nthreads(threads)
        )
        if rc != 0:
            raise MemoryError("hc_dense_tail: out of memory")
        return y1, y2


class ThresholdedPlan(_LayerTail):
    """One thresholded SwiGLU FFN step (sparse/thresholded.py) in one C call: s = matmul(score, h) (the gate
    probe, or the gate itself when `gate` is None), neuron i of a token kept iff |silu(s)| (* scale[i]) >
    threshold in float32, then on the kept rows the exact gate (with a probe), up, silu(gate) * up and the
    axpy over down_t. Equal bit for bit to those ops one by one for a score weight `matmul` multiplies in C
    (the caller checks `ops.uses_c_kernels`; below GEMM_MIN_TOKENS rows every such weight runs in C). ValueError
    for shapes it cannot take; keeps its weights alive."""

    def __init__(
        self,
        score: Weight,
        up: Weight,
        gate: Weight | None,
        down_t: Weight,
        *,
        threshold: float,
        scale: torch.Tensor | None = None,
        score_in: tuple[torch.Tensor | None, float] | None = None,
        activation: str = "silu",
    ):
        """score_in: (channel weights [D] or None, threshold): score is then gate_t [D, F], multiplied by
        each token's input channels over the threshold only (sparsify --gate-probe inputs). activation: the
        gate's, one of C_ACTIVATIONS (silu; gelu_tanh for Gemma's GeGLU), in the score and the product."""
        if activation not in C_ACTIVATIONS:
            raise ValueError(
                f"activation {activation!r} has no C form (C_ACTIVATIONS: {sorted(C_ACTIVATIONS)})"
            )
        self.act = C_ACTIVATIONS[activation]
        self.weights = (score, up, gate, down_t)  # kept alive: the structs point into them
        self.score, self.up, self.gate, self.down_t = (hc_weight(w) for w in self.weights)
        self.f, self.d = self.up.rows, self.up.cols
        for name, w in (("score", self.score), ("gate", self.gate), ("down_t", self.down_t)):
            want = (self.d, self.f) if name == "score" and score_in is not None else (self.f, self.d)
            if w is not None and (w.rows, w.cols) != want:
                raise ValueError(f"{name} has shape {(w.rows, w.cols)}, expected {want}")
        self.score_in = None
        if score_in is not None:
            in_scale = None if score_in[0] is None else score_in[0].to(torch.float32).contiguous()
            if in_scale is not None and in_scale.shape != (self.d,):
                raise ValueError(f"input scale has shape {tuple(in_scale.shape)}, expected [{self.d}]")
            self._in_scale = in_scale  # kept alive: the rule points into it
            self.score_in = build.HCInRule(ptr(in_scale), float(score_in[1]))
        self._score_in_ref = None if self.score_in is None else ctypes.byref(self.score_in)
        self.scale = None if scale is None else scale.to(torch.float32).contiguous()
        if self.scale is not None and self.scale.shape != (self.f,):
            raise ValueError(f"scale has shape {tuple(self.scale.shape)}, expected [{self.f}]")
        self.threshold = float(threshold)
        structs = (self.score, self.up, self.gate, self.down_t)
        self._args = tuple(None if w is None else ctypes.byref(w) for w in structs)

    def __call__(
        self, h: torch.Tensor, *, norm: tuple[torch.Tensor, float] | None = None, threads: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """h [T, D] (with norm = (weight, eps): the residual whose rms_norm is the FFN input) -> (out [T, D],
        kept mask [T, F] bool, kept count); None without the C kernels."""
        lib = build.get_lib()
        if lib is None:
            return None
        h2, _ = as_tokens(h, self.d, "h")
        t = h2.shape[0]
        norm_w, eps = norm_weight(norm, self.d)
        mask = torch.empty(t, self.f, dtype=torch.bool)
        out = torch.empty(t, self.d, dtype=torch.float32)
        score, up, gate, down_t = self._args
        kept = lib.hc_thresholded_ffn(
            score, self._score_in_ref, ptr(self.scale), self.threshold, self.act, up, gate, down_t, t, h2.data_ptr(),
            ptr(norm_w), eps,
            mask.data_ptr(), out.data_ptr(), nthreads(threads),
        )  # fmt: skip
        if kept < 0:
            raise MemoryError("hc_thresholded_ffn: out of memory")
        return out, mask, int(kept)

    _tail_fn = "hc_thresholded_tail"

    def _tail_ffn_args(self) -> tuple:
        score, up, gate, down_t = self._args
        return score, self._score_in_ref, ptr(self.scale), self.threshold, self.act, up, gate, down_t
