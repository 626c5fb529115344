"""hotcold.kernels.torch_decode: the torch fallback of the fused decode kernels multiplies in float32 on
every device (#46: on a GPU it multiplied in the weights' fp16, so ~0.46 predictor decisions a layer a
token differed from the fused kernels' fp32). The GPU's dispatch is seen on the `meta` device: every
matrix product the step runs must take float32 operands."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hotcold.kernels import torch_decode
from hotcold.kernels.torch_decode import TorchKernels

aten = torch.ops.aten
_PRODUCTS = {aten.mm.default, aten.addmm.default, aten.mv.default, aten.bmm.default, aten.matmul.default}


class ProductDtypes(TorchDispatchMode):
    """The dtypes of every matrix product's operands dispatched inside the block."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, tuple[torch.dtype, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _PRODUCTS:
            dtypes = tuple(a.dtype for a in args if isinstance(a, torch.Tensor))
            self.seen.append((str(func), dtypes))
        return func(*args, **(kwargs or {}))


def test_fallback_products_are_float32_on_a_gpu_like_device():
    """fp16 weights on `meta` (what a GPU dispatches): the o projection, predictor, gate/up and down_t axpy
    products all read float32 operands, as the fused kernels compute."""
    meta = dict(device="meta")
    D, F, R = 256, 512, 64
    k = TorchKernels()
    w16 = torch.empty(F, D, dtype=torch.float16, **meta)
    x = torch.empty(D, **meta)
    with ProductDtypes() as mode:
        k.gemv(torch.empty(D, D, dtype=torch.float16, **meta), x, out=torch.empty(D, **meta), residual=x)
        r = torch.empty(R, **meta)
        k.gemv(torch.empty(R, D, dtype=torch.float16, **meta), x, out=r, relu=True)
        mask = torch.empty(F, dtype=torch.int8, **meta)
        count = torch.zeros(1, dtype=torch.int32, **meta)
        k.gemv(
            torch.empty(F, R, dtype=torch.float16, **meta),
            r,
            out=r,
            threshold=0.0,
            mask_out=mask,
            count=count,
        )
        a = torch.empty(F, **meta)
        k.gate_up(w16, w16, x, mask, a, kind="gated", activation="relu")
        k.down_axpy(w16, a, x, None, torch.empty(D, **meta))
    assert len(mode.seen) >= 6, mode.seen
    assert all(set(dtypes) == {torch.float32} for _, dtypes in mode.seen), mode.seen


def test_widening_in_row_blocks_gives_the_same_product(monkeypatch):
    """A matrix wider than the widening block is multiplied a block of rows at a time: the same numbers as
    one product over the whole float32 matrix."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(37, 24, generator=gen).half()
    x = torch.randn(24, generator=gen)
    whole = torch.nn.functional.linear(x, w.float())
    monkeypatch.setattr(torch_decode, "_WIDEN_BYTES", 5 * 24 * 4)  # 5 rows a block, 8 blocks
    torch.testing.assert_close(torch_decode._mm(x, w), whole, rtol=1e-6, atol=1e-6)
    a = torch.randn(37, generator=gen)  # down_axpy's a @ down_t, through the transposed view
    torch.testing.assert_close(torch_decode._mm(a, w.T), a @ w.float(), rtol=1e-6, atol=1e-6)
