"""The sparse FFN's row kernels on a model's own masks: as hotcold runs them, against a dense hot block.

A batch reads the union of its tokens' firing rows, and the hottest rows fire for nearly every token. On the
masks the model's predictors give (one decode token, a batched decode step of B sequences, a prompt chunk of P
tokens), this times every layer's gate gather and down axpy as hotcold computes them (`hc_gather_matvec`,
`hc_sparse_axpy`) against the same work split in two, PowerInfer's dense hot neurons on the CPU: the H hottest
rows (a file's first rows once kept hottest first) as one packed product for every token (`hc_packed_matvec`),
the others gathered as before. The split gives the hot rows another arithmetic (one fma chain per row and token,
as the packed products), so it is checked against the whole to float tolerance, not bits; the same split at every
token count would keep a batch's output equal to each token's alone. (Built so in 9bb5c82 and reverted: inside the
sparse step the three extra packed calls a layer made one token's FFN 1.15-1.27x slower; see RESULTS_LOG.md,
2026-12-04.)

    python benchmarks/ffn_split.py -m MODEL [-t 2] [--batch 8] [--prompt 85] [--hot 256,512] [--rounds 11]
                                   [--json OUT]

Prints a table and JSON. Needs a sparse model with float16 / bfloat16 FFN weights (the packed form of rows).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import hotcold
from hotcold.kernels import build, cpu
from hotcold.kernels.build import WT, Q, weight_view
from hotcold.runtime import batching
from hotcold.runtime.engine import Engine
from hotcold.runtime.generation import Generation

if not __package__:  # run as `python benchmarks/ffn_split.py`: the checkout, not benchmarks/, goes first on
    sys.path[0] = str(
        Path(__file__).resolve().parents[1]
    )  # sys.path (a sibling must never shadow a dependency)
from benchmarks.kernel_bandwidth import cpu_name  # noqa: E402

_HALF = {Q.F16: torch.float16, Q.BF16: torch.bfloat16}


def in_row_order(llm, masks: list[torch.Tensor]) -> list[torch.Tensor]:
    """Masks as profiling keeps them (the file's neuron order) -> in the order of the weights' rows (the kernels'
    order: hottest first where the loader reordered the neurons)."""
    out = []
    for layer, m in zip(llm.loaded.model.layers, masks):
        order = layer.ffn.weights.order
        out.append(m if order is None else m[:, order.to(m.device)])
    return out


def decode_masks(llm, batch: int) -> list[torch.Tensor]:
    """Every layer's mask [batch, F] of one decode step of `batch` sequences (each from its own 2-token
    prompt, a few steps in)."""
    model = llm.loaded.model
    gen = torch.Generator().manual_seed(batch)
    bos = llm.tokenizer.bos_id or 1
    engines = [Engine(model, llm.tokenizer, 16) for _ in range(batch)]
    prompts = [[bos, int(t)] for t in torch.randint(3, llm.config.n_vocab, (batch,), generator=gen)]
    gens = [Generation(e, p, max_tokens=4, ignore_eos=True) for e, p in zip(engines, prompts)]
    for e in engines:
        e.seq.keep_masks = True
    while any(not g.done for g in gens):
        batching.step(model, gens)
    layers = range(len(model.layers))
    return in_row_order(llm, [torch.cat([e.seq.masks[i][1].reshape(1, -1) for e in engines]) for i in layers])


def prompt_masks(llm, tokens: int) -> list[torch.Tensor]:
    """Every layer's mask [tokens, F] of one forward over a prompt of random ids."""
    gen = torch.Generator().manual_seed(tokens)
    ids = [int(t) for t in torch.randint(3, llm.config.n_vocab, (tokens,), generator=gen)]
    seq = llm.engine.seq
    seq.keep_masks = True
    try:
        llm.logits(ids)
        return in_row_order(
            llm, [seq.masks[i][1].reshape(tokens, -1).clone() for i in range(len(llm.loaded.model.layers))]
        )
    finally:
        seq.keep_masks = False
        seq.masks.clear()


def first_rows(weight, rows: int) -> torch.Tensor:
    """The first `rows` rows [rows, D] of a float16 / bfloat16 weight, as a contiguous tensor."""
    qtype, data, _, _, d = weight_view(weight)
    if qtype not in _HALF:
        raise SystemExit(f"ffn_split: FFN weights are {qtype.name}; the hot block needs float16 or bfloat16")
    part = data[:rows]
    if part.dtype == torch.uint8:
        part = part.contiguous().view(_HALF[qtype])[:, :d]
    return part.contiguous()


def median_ms(times: list[float]) -> float:
    return round(statistics.median(times) * 1e3, 3)


def measure_case(lib, layers, masks: list[torch.Tensor], hot: int, rounds: int, threads: int) -> dict:
    """Gate gather and down axpy of every layer over `masks`, whole and split at `hot` rows: median ms over
    `rounds` alternating rounds, and the largest difference between the two results."""
    gates = [weight_view(L.ffn.weights.gate) for L in layers]
    downs = [weight_view(L.ffn.weights.down_t) for L in layers]
    f, d = gates[0][3], gates[0][4]
    t = masks[0].shape[0]
    gen = torch.Generator().manual_seed(t)
    full = [m.to(torch.uint8).contiguous() for m in masks]
    cold = [m.clone() for m in full]
    for m in cold:
        m[:, :hot] = 0
    coef = [(torch.rand(t, f, generator=gen) * m).contiguous() for m in full]
    coef_hot = [c[:, :hot].contiguous() for c in coef]
    gate_hot = [cpu.pack(first_rows(L.ffn.weights.gate, hot)) for L in layers]
    down_hot = [cpu.pack(first_rows(L.ffn.weights.down_t, hot).t().contiguous()) for L in layers]  # [D, H]
    x = torch.randn(t, d, generator=gen)
    g_whole, g_cold, g_hot = torch.empty(t, f), torch.empty(t, f), torch.empty(t, hot)
    a_whole, a_cold, a_hot = torch.empty(t, d), torch.empty(t, d), torch.empty(t, d)

    xs = [x] * len(layers)

    def layers_run(fn, views, inputs, masks_, out, hot_block=None):
        """fn (hc_gather_matvec or hc_sparse_axpy) over every layer, each followed by its hot block's packed
        product when hot_block = (packed parts, rows, cols, inputs, out) is given."""
        for i, (qt, data, stride, _, _) in enumerate(views):
            fn(
                WT[qt],
                data.data_ptr(),
                stride,
                f,
                d,
                inputs[i].data_ptr(),
                t,
                masks_[i].data_ptr(),
                out.data_ptr(),
                threads,
            )
            if hot_block is not None:
                parts, rows, cols, hot_inputs, hot_out = hot_block
                p = parts[i]
                packed, hot_in, hot_res = p.packed.data_ptr(), hot_inputs[i].data_ptr(), hot_out.data_ptr()
                lib.hc_packed_matvec(WT[p.qtype], packed, rows, cols, hot_in, t, hot_res, threads)

    gather, axpy = lib.hc_gather_matvec, lib.hc_sparse_axpy
    runs = {
        "gate_whole": lambda: layers_run(gather, gates, xs, full, g_whole),
        "gate_split": lambda: layers_run(gather, gates, xs, cold, g_cold, (gate_hot, hot, d, xs, g_hot)),
        "down_whole": lambda: layers_run(axpy, downs, coef, full, a_whole),
        "down_split": lambda: layers_run(
            axpy, downs, coef, cold, a_cold, (down_hot, d, hot, coef_hot, a_hot)
        ),
    }
    times: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(rounds):
        for name in runs if r % 2 == 0 else reversed(runs):
            start = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - start)
    # the last layer's results: the split's, put together, against the whole
    split_gate = g_cold.clone()
    split_gate[:, :hot] = torch.where(full[-1][:, :hot].bool(), g_hot, torch.zeros(()))
    gate_diff = float((split_gate - g_whole).abs().max())
    down_diff = float((a_cold + a_hot - a_whole).abs().max())
    scale = max(float(g_whole.abs().max()), float(a_whole.abs().max()), 1e-30)
    if max(gate_diff, down_diff) > 1e-4 * scale:
        raise SystemExit(
            f"ffn_split: the split's results differ from the whole by {max(gate_diff, down_diff)}"
        )
    stack = torch.stack(full).bool()  # [layers, T, F]
    return {
        "tokens": t,
        "hot_rows": hot,
        "firing_per_token": round(float(stack.float().mean()), 4),
        "union": round(float(stack.any(1).float().mean()), 4),
        "hot_rows_firing_per_token": round(float(stack[..., :hot].float().mean()), 4),
        "ms": {k: median_ms(v) for k, v in times.items()},
        "largest_difference": {"gate": gate_diff, "down": down_diff},
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8, help="sequences of the batched decode step (default 8)")
    ap.add_argument("--prompt", type=int, default=85, help="tokens of the prompt chunk (default 85)")
    ap.add_argument("--hot", default="256,512", help="hot block sizes, comma-separated (default 256,512)")
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args(argv)
    hots = [int(h) for h in args.hot.split(",")]
    lib = build.get_lib()
    if lib is None:
        raise SystemExit("ffn_split: the C kernels did not build (no C compiler?)")
    llm = hotcold.load(args.model, device="cpu", threads=args.threads, kv_sequences=max(1, args.batch))
    layers = llm.loaded.model.layers
    if not all(hasattr(L.ffn, "predictor") and L.ffn.predictor is not None for L in layers):
        raise SystemExit(f"ffn_split: {args.model} is not a sparse model with predictors")
    n_ff = weight_view(layers[0].ffn.weights.gate)[3]
    if any(h < 1 or h >= n_ff for h in hots):
        raise SystemExit(f"ffn_split: --hot sizes must be 1..{n_ff - 1}, got {args.hot}")
    captures = [("decode", decode_masks(llm, 1))]
    if args.batch > 1:
        captures.append((f"batch {args.batch}", decode_masks(llm, args.batch)))
    if args.prompt > 1:
        captures.append((f"prompt {args.prompt}", prompt_masks(llm, args.prompt)))
    cases = []
    for what, masks in captures:
        for hot in hots:
            case = {"what": what, **measure_case(lib, layers, masks, hot, args.rounds, args.threads)}
            cases.append(case)
            ms = case["ms"]
            print(
                f"{what:>10} H={hot:<5} firing {case['firing_per_token']:.3f} union {case['union']:.3f} "
                f"(hot rows {case['hot_rows_firing_per_token']:.3f}): gate {ms['gate_whole']:.2f} -> "
                f"{ms['gate_split']:.2f} ms, down {ms['down_whole']:.2f} -> {ms['down_split']:.2f} ms",
                flush=True,
            )
    result = {
        "date": datetime.datetime.now().isoformat(timespec="minutes"),
        "model": str(args.model),
        "layers": len(layers),
        "threads": args.threads,
        "machine": {"cpu": cpu_name(), "torch": torch.__version__},
        "rounds": args.rounds,
        "cases": cases,
    }
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
