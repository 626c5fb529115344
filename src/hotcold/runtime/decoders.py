"""Which code runs a model's decode steps, chosen once at load from the layer descriptions (models/base.LayerSpec)
and the device plan: the one place that decides it.

- "cuda_graph": a model entirely on one GPU; the fixed-shape step captured in a CUDA graph (decode_step.py).
- "cpu_one_call": a model on the CPU whose layers the C decode layer computes; every layer of a decode token in
  one C call (cpu_step.py).
- "eager": the family's forward, layer by layer (each layer still picks its C or Triton kernels).

Each fast decoder holds the eager one to fall back to: forwards it does not run (a prompt chunk, profiling, a
dense batch) go through the family's forward, and where it fails on its first step the model decodes eagerly from
then on and says why (`model.decoder_failure`, a warning, `hotcold info`). `HOTCOLD_STATIC_STEP=0` (documented in
the README) keeps a GPU model on the eager step, to compare the two.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

DECODERS = ("eager", "cpu_one_call", "cuda_graph")


def choose_decoder(model, *, requested: str = "auto", ctx_size: int, notes: list[str]) -> str:
    """Set `model.decoder` (one of DECODERS) and the decoder object it names (`model.static_step` for
    cuda_graph, `model.cpu_decode` for cpu_one_call; None otherwise); a note says which and, for eager, why.
    requested: "auto" or "eager" (LoadOptions.decoder, checked there)."""
    model.static_step = None
    model.cpu_decode = None
    model.decoder_failure = None
    model.rows_own_bits = rows_own_bits(model)
    model.decoder, why = "eager", "decoder='eager' asked for"
    if requested == "auto":
        model.decoder, why = _fastest(model, ctx_size)
    if model.decoder == "eager":
        notes.append(f"decode: eager, layer by layer ({why})")
    else:
        notes.append(f"decode: {model.decoder} ({why})")
    return model.decoder


def rows_own_bits(model) -> bool:
    """Whether a row's arithmetic never depends on the rest of its forward below cpu.GEMM_MIN_TOKENS rows (the
    batching contract, hotcold.runtime.batching): a model all on the CPU, computed by the C kernels, whichever of its
    decoders runs. Engines then share a prompt's cached rows between sequences (Engine.exact)."""
    from hotcold.kernels import build

    plan = getattr(model, "plan", None)
    return (
        plan is not None
        and plan.fast is None
        and all(d.type == "cpu" for d in (*plan.attention, *plan.predictor, *plan.ffn, plan.output))
        and build.get_lib() is not None  # last: a model off the CPU never needs the library built
    )


def _fastest(model, ctx_size: int) -> tuple[str, str]:
    """(decoder, what it runs or why it is eager) for a model whose decoder is chosen automatically."""
    layers = getattr(model, "layers", None) or []
    if any(getattr(getattr(layer, "ffn", None), "reads_storage", False) for layer in layers):
        # storage/ffn.StoredFFN: the rows a layer computes are read between its predictor and its FFN
        return "eager", "--ram-budget: cold FFN rows are read from the file after each layer's predictor"
    head = getattr(model, "head", None)
    if getattr(head, "softcap", 0.0) and head.device.type == "cuda":  # the CPU decoder runs the family's Head
        return "eager", "soft-capped output logits, which the GPU step does not compute yet"
    on_gpu = head is not None and head.device.type == "cuda"
    if on_gpu:
        if os.environ.get("HOTCOLD_STATIC_STEP", "1") == "0":
            return "eager", "HOTCOLD_STATIC_STEP=0"
        from hotcold.runtime import decode_step

        step, why = decode_step.from_model(model, ctx_size=ctx_size)
        if step is None:
            return "eager", why
        model.static_step = step
        kernels = "fused Triton kernels" if step.fused else "torch kernels"
        return "cuda_graph", f"the fixed-shape step in a CUDA graph, {kernels}"
    from hotcold.runtime import cpu_step

    why = cpu_step.unsupported(model)
    if why is not None:
        return "eager", why
    model.cpu_decode = cpu_step.CPUDecoder(model, on_failure=lambda why: fall_back(model, why))
    return "cpu_one_call", "every layer of a decode token in one C call"


def fall_back(model, failure: str) -> None:
    """A fast decoder failed on its first step: decode eagerly from now on, and keep why."""
    log.warning("the %s decoder failed on its first step, decoding eagerly: %s", model.decoder, failure)
    model.decoder_failure = f"{model.decoder}: {failure}"
    model.decoder = "eager"
    model.static_step = None
    model.cpu_decode = None
