"""The output head of a decode step whose sampler reads only its largest logits: only the rows that can be among
them, proven, not predicted.

A greedy step reads the argmax, a top-k step (llama.cpp's default sampling: top-k 40, then temperature, top-p,
min-p over those k) the k largest logits; neither needs the whole head, which for the 150k-262k vocabularies of
Qwen and Gemma is 10-25% of a token's bytes (`state.HeadNeed`, from Generation.head_need: none for logprobs, a
grammar, or sampling without top-k). The screen is a Q8_0 copy of a 16-bit head (53% of its bytes, made at load),
with per row r the bounds err[r] >= |w_r - q_r| and qnorm[r] >= |q_r|. The screen's product s_r = q_r . x' (x' =
x quantized to int8 in chunks of 32, as every block-weight kernel does) is within

    b_r = err[r] |x| + qnorm[r] |x - x'| + RELATIVE_SLACK qnorm[r] |x'|

of the exact w_r . x (Cauchy-Schwarz twice; the last term covers float32 rounding in both products, far above
it). With lo the k-th largest s_r - b_r over the rows the repeat penalty leaves alone, every row with s_r + b_r <
lo is below k rows that are computed: never among the k largest, whatever the penalty does to the rows in its
window (which are computed too). The others (tens of rows for greedy on the heads measured; `head_rows` in a
sequence's counts) are computed exactly from the head itself by the row kernel (hc_gather_matvec) and every other
logit is -inf. Greedy tokens are therefore the full head's, for any weights and input, with no training and no
fallback; top-k sampling draws from the same k logits (computed by the row kernel, where the full head's packed
product may differ in the last bit). Where the bounds are loose more rows are computed, never fewer than needed.

Kept to float heads (F32/F16/BF16): for a head already in a block format a cheaper copy's bounds would be too
loose to skip rows (Q4_0's error is ~15x Q8_0's).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from hotcold.gguf.quants import QuantTensor
from hotcold.kernels import build
from hotcold.kernels.build import WT, nthreads, weight_view
from hotcold.kernels.cpu import gather_matvec
from hotcold.kernels.pages import page_out

# Bound on the float32 rounding of both products relative to |q| |x'| (each is a sum of D terms, error
# <= D * 2^-24 * sum |terms| <= 6e-5 of that for D = 1024; 16384 columns would still be within 1e-3).
RELATIVE_SLACK = 1e-3
# Below this many rows the full head is read (its bytes are too few to save anything).
MIN_ROWS = 4096


class HeadScreen:
    """A head's Q8_0 screen and per-row bounds (see the module's docstring); `build` makes one or None."""

    def __init__(self, packed: torch.Tensor, err: torch.Tensor, qnorm: torch.Tensor, d: int):
        # float64 once here: the bounds are summed in float64 every step
        self.packed, self.err, self.qnorm = packed, err.double(), qnorm.double()
        self.n_rows, self.d = err.shape[0], d

    @classmethod
    def build(cls, weight, *, threads: int | None = None) -> HeadScreen | None:
        """The screen of a CPU float head [V, D], or None where there is none to make (no C kernels, a
        block-format or GPU head, D not a multiple of 32, too few rows, NaN/inf in the head)."""
        lib = build.get_lib()
        if lib is None:
            return None
        try:
            qtype, data, stride, f, d = weight_view(weight)
        except (TypeError, ValueError):
            return None
        if d % 32 or f < MIN_ROWS or qtype not in (build.Q.F32, build.Q.F16, build.Q.BF16):
            return None
        q8 = torch.empty(f, d // 32 * 34, dtype=torch.uint8)
        err, qnorm = torch.empty(f, dtype=torch.float32), torch.empty(f, dtype=torch.float32)
        rc = lib.hc_screen_q8_0(
            WT[qtype], data.data_ptr(), stride, f, d, q8.data_ptr(), err.data_ptr(), qnorm.data_ptr(),
            nthreads(threads),
        )  # fmt: skip
        if rc != 0 or not (bool(torch.isfinite(err).all()) and bool(torch.isfinite(qnorm).all())):
            return None
        packed = torch.empty(lib.hc_packed_nbytes(WT[build.Q.Q8_0], f, d), dtype=torch.uint8)
        if lib.hc_pack(WT[build.Q.Q8_0], q8.data_ptr(), q8.shape[1], f, d, packed.data_ptr()) != 0:
            return None
        if isinstance(weight, QuantTensor) and weight.packed is not None:
            # the file's rows read here leave RSS again, as cpu.pack left them (its packed copy serves the head)
            page_out(data.data_ptr(), f * stride)
        return cls(packed, err, qnorm, d)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + 16 * self.n_rows

    def takes(self, need, x: torch.Tensor) -> bool:
        """Whether this screen serves `need` (state.HeadNeed) for x: CPU rows, and few enough rows wanted that
        the screen's bytes buy something (a top-k over a sixteenth of the vocabulary reads the whole head)."""
        return x.device.type == "cpu" and x.dim() == 2 and 1 <= need.top <= self.n_rows // 16

    def candidates(
        self, x: torch.Tensor, *, top: int = 1, keep=(), threads: int | None = None
    ) -> torch.Tensor:
        """bool [T, V]: the rows that may be among each row of x's `top` largest logits (x [T, D] float32, the
        normed input), with the rows keep[j] of row j always in. The top-th largest lower bound over the rows not
        kept is met or beaten by `top` rows that are in, and their exact logits are at least it, so a row left out
        (its upper bound below it) is below all of them: not in the top, whatever the sampler does to the kept.
        One C pass over the rows for the lower bounds' top, one for the mask (hc_screen_select), in the float64
        arithmetic of `bounds`."""
        x = x.to(torch.float32).contiguous()
        s, a, c = self._products(x, threads)
        t = x.shape[0]
        ids = [list(keep[j]) if j < len(keep) and keep[j] else [] for j in range(t)]
        offsets = torch.tensor([0] + [len(i) for i in ids], dtype=torch.int64).cumsum(0)
        flat = torch.tensor([r for i in ids for r in i], dtype=torch.int64)
        mask = torch.empty(t, self.n_rows, dtype=torch.uint8)
        rc = build.get_lib().hc_screen_select(
            t, self.n_rows, s.data_ptr(), self.err.data_ptr(), self.qnorm.data_ptr(), a.data_ptr(), c.data_ptr(),
            top, flat.data_ptr() if len(flat) else None, offsets.data_ptr(), mask.data_ptr(), nthreads(threads),
        )  # fmt: skip
        if rc < 0:
            raise ValueError(f"hc_screen_select: top {top} of {self.n_rows} rows, or a kept row out of range")
        return mask.view(torch.bool)

    def bounds(self, x: torch.Tensor, *, threads: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the screen's products s, bounds b), float64 [T, V]: |w_r . x - s_r| <= b_r for every row r."""
        s, a, c = self._products(x.to(torch.float32).contiguous(), threads)
        return s.double(), self.err[None] * a[:, None] + self.qnorm[None] * c[:, None]

    def _products(
        self, x: torch.Tensor, threads: int | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(s [T, V] float32: the screen's products, a [T] = |x|, c [T] = |x - x'| + RELATIVE_SLACK |x'|, both
        float64): the bound on row r's error is err[r] a + qnorm[r] c."""
        t = x.shape[0]
        s = torch.empty(t, self.n_rows, dtype=torch.float32)
        lib = build.get_lib()
        rc = lib.hc_packed_matvec(
            WT[build.Q.Q8_0], self.packed.data_ptr(), self.n_rows, self.d, x.data_ptr(), t, s.data_ptr(),
            nthreads(threads),
        )  # fmt: skip
        if rc != 0:
            raise MemoryError("hc_packed_matvec failed (the head's screen)")
        # |x - x'| from each chunk's scale: an element is off by at most half a step (amax / 127 / 2; the
        # 1.001 covers the rounding of x * 127 / amax before it is rounded to an integer)
        x64 = x.double()
        chunk_amax = x64.reshape(t, -1, 32).abs().amax(-1)
        x_off = (chunk_amax / 127 * 0.5 * 1.001).square().sum(-1).mul(32).sqrt()
        x_norm = x64.norm(dim=-1)
        x_quant_norm = x_norm + x_off  # |x'| <= |x| + |x - x'|
        return s, x_norm.contiguous(), (x_off + RELATIVE_SLACK * x_quant_norm).contiguous()

    def rows(
        self, weight, x: torch.Tensor, *, top: int = 1, keep=(), threads: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(products [T, V] float32: the candidates' exact (hc_gather_matvec, as `matmul` of an unpacked head;
        0 elsewhere), the candidates bool [T, V]) for the head `weight` this screen was made from."""
        x = x.to(torch.float32).contiguous()
        mask = self.candidates(x, top=top, keep=keep, threads=threads)
        return gather_matvec(weight, x, mask, threads=threads), mask


def attach_screen(model, *, threads: int | None = None, notes: list[str] | None = None) -> None:
    """Give the model's head a screen where one can be made (HeadScreen.build), saying so in `notes`; at load."""
    head = getattr(model, "head", None)
    screen = None if head is None else HeadScreen.build(head.weight, threads=threads)
    if screen is not None:
        model.head = replace(head, screen=screen)
        if notes is not None:
            notes.append(
                f"head screen: a Q8_0 copy of the output head ({screen.nbytes / 2**20:.0f} MiB more memory); greedy "
                "and top-k steps compute only the rows that can be chosen (--no-head-screen: the whole head)"
            )
