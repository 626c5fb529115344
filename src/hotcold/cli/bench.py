"""hotcold bench: a llama-bench-like table of prompt processing (ppN) and generation (tgN) speed, sparse and
dense measured in the same run (interleaved), with effective GB/s of weights read and the firing rate, and
under the table each test's sparse / dense ratio (for `-b` batches with the union firing rate: the rows a
step reads). `-t 1,2` measures each thread count in turn; `--plot OUT.png` draws tokens/s by thread count (several
-t) or by batch size (-b), sparse vs dense (hotcold.plots)."""

from __future__ import annotations

import json
import math
import statistics
import sys
import time

import torch

from hotcold.gguf import names
from hotcold.runtime.state import HeadNeed


def add_args(p) -> None:
    p.add_argument("-m", "--model", default=None, help="model file; omitted: the bundled demo model")
    p.add_argument("-p", "--n-prompt", type=int, default=512, help="prompt tokens for the pp test (0: skip)")
    p.add_argument("-n", "--n-gen", type=int, default=128, help="generated tokens for the tg test (0: skip)")
    p.add_argument(
        "-d",
        "--n-depth",
        default="0",
        help="comma-separated context depths for tg (e.g. 0,512,2048): tokens already in the KV cache when the "
        "timed decode starts, as llama-bench -d (attention reads them every token)",
    )
    p.add_argument("-r", "--repetitions", type=int, default=3)
    p.add_argument(
        "-t",
        "--threads",
        dest="thread_counts",
        default=None,
        help="CPU threads, or comma-separated counts to measure each (e.g. 1,2)",
    )
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--vram-budget", type=float, default=None)
    p.add_argument(
        "--ram-budget",
        type=float,
        default=None,
        help="GiB of RAM for the model (as hotcold generate's): cold rows read from the file when selected",
    )
    p.add_argument(
        "--mode", choices=("both", "sparse", "dense"), default="both", help="which paths to measure"
    )
    p.add_argument(
        "-b",
        "--batch",
        default="1",
        help="comma-separated batch sizes for tg (e.g. 1,4,8): B sequences decoding together, one forward a step",
    )
    p.add_argument(
        "--sparsity",
        type=float,
        default=None,
        help="`hotcold sparsify` files: share of FFN neurons the sparse mode skips (default: the file's)",
    )
    p.add_argument(
        "--decoder",
        choices=("auto", "eager"),
        default="auto",
        help="decode steps: the fastest decoder the model allows (auto), or layer by layer (eager)",
    )
    p.add_argument(
        "--no-head-screen",
        dest="head_screen",
        action="store_false",
        help="compute every output-head row each step, as llama-bench does (default: tg reads the argmax only, "
        "so a float head's screen computes only the rows that can win; the same tokens)",
    )
    p.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    p.add_argument(
        "--plot",
        metavar="OUT.png",
        default=None,
        help="also draw tokens/s by thread count or batch size, sparse vs dense (needs hotcold[plot])",
    )


def weight_bytes(model_file) -> dict[str, int]:
    """Bytes a decode step reads, split by role: FFN matrices (what sparsity saves), predictors, the rest.
    The token embedding is excluded: a step reads one row of it. A `hotcold sparsify` file reads its gate
    whole (counted as "other") and one of ffn_down / ffn_down_t, of q/k/v / attn_qkv_t and of attn_output /
    attn_output_t (each counted once)."""
    parts = {"ffn": 0, "predictor": 0, "other": 0}
    sparsified = names.SPARSIFY_SPARSITY in model_file.metadata
    for entry in model_file.tensors.values():
        name = entry.name
        if name == names.tensor(names.TOKEN_EMBD) and names.tensor(names.OUTPUT) in model_file.tensors:
            continue
        if sparsified and names.template_of(
            name, (names.FFN_DOWN_T, names.FFN_GATE_T, names.ATTN_QKV_T, names.ATTN_OUT_T)
        ):
            continue  # a second copy of matrices counted once
        if sparsified and names.template_of(name, (names.FFN_GATE,)):
            parts["other"] += entry.n_bytes
        elif names.template_of(name, names.FFN_MATRICES):
            parts["ffn"] += entry.n_bytes
        elif names.template_of(name, names.PREDICTOR_MATRICES):
            parts["predictor"] += entry.n_bytes
        else:
            parts["other"] += entry.n_bytes
    return parts


def _firing(llm) -> tuple[int, int]:
    return llm.engine.seq.neuron_totals()


def measure(llm, test: str, n: int, depth: int = 0) -> tuple[float, float, float]:
    """Seconds for one run of the test, the firing rate seen during it, and the share of the output head's rows
    computed. tg after `depth` tokens of context: their prefill is not timed (nor counted). tg is greedy
    decoding: each step's logits are read for their argmax only (so a head screen computes the rows that can
    win, head_screen.py)."""
    engine = llm.engine
    gen = torch.Generator().manual_seed(0)
    ids = [llm.tokenizer.bos_id or 1] + torch.randint(
        3, llm.config.n_vocab, (n + depth,), generator=gen
    ).tolist()
    c0, t0 = _firing(llm)
    with torch.inference_mode():
        if test == "pp":
            engine.cached_ids = []
            start = time.perf_counter()
            engine.prefill(ids[: n + 1])
            seconds = time.perf_counter() - start
        else:
            engine.cached_ids = []
            logits = engine.prefill(ids[: depth + 1])
            c0, t0 = _firing(llm)
            h0 = list(engine.seq.head_rows)
            start = time.perf_counter()
            token = int(torch.argmax(logits))
            for pos in range(depth + 1, depth + n + 1):
                logits = engine.forward([token], pos, last_only=True, head_need=HeadNeed(1))[-1]
                token = int(torch.argmax(logits))
            seconds = time.perf_counter() - start
    c1, t1 = _firing(llm)
    h1 = engine.seq.head_rows
    share = (h1[0] - h0[0]) / (h1[1] - h0[1]) if test != "pp" and h1[1] > h0[1] else 1.0
    return seconds, (c1 - c0) / (t1 - t0) if t1 > t0 else 1.0, share


def measure_batch(llm, n: int, batch: int) -> tuple[float, float, float, float]:
    """B sequences (different random prompts of 2 tokens) decoding n tokens each in one forward per step
    (hotcold.runtime.batching): seconds, the firing rate per token, the union firing rate per step (the share
    of each layer's neurons fired by any token of the batch: the rows the sparse kernels read), and the share
    of the output head's rows computed (greedy steps: a screened head computes the rows that can win)."""
    from hotcold.runtime import batching, engine, generation

    model = llm.loaded.model
    gen = torch.Generator().manual_seed(batch)
    bos = llm.tokenizer.bos_id or 1
    engines = [engine.Engine(model, llm.tokenizer, n + 4) for _ in range(batch)]
    prompts = [[bos, int(t)] for t in torch.randint(3, llm.config.n_vocab, (batch,), generator=gen)]
    gens = [generation.Generation(e, p, max_tokens=n, ignore_eos=True) for e, p in zip(engines, prompts)]
    batching.step(model, gens)  # the prefills (untimed) and the first token
    before = [e.seq.neuron_totals() for e in engines]
    head0 = [list(e.seq.head_rows) for e in engines]
    start = time.perf_counter()
    while any(not g.done for g in gens):
        batching.step(model, gens)
    seconds = time.perf_counter() - start
    after = [e.seq.neuron_totals() for e in engines]
    head_rows = [sum(e.seq.head_rows[i] - h[i] for e, h in zip(engines, head0)) for i in (0, 1)]
    computed = sum(a[0] - b[0] for a, b in zip(after, before))
    total = sum(a[1] - b[1] for a, b in zip(after, before))
    # the union, measured apart (recording masks costs time): a few more steps with masks kept
    union = []
    gens = [generation.Generation(e, p, max_tokens=4, ignore_eos=True) for e, p in zip(engines, prompts)]
    for e in engines:
        e.seq.keep_masks = True
    while any(not g.done for g in gens):
        batching.step(model, gens)
        layers = engines[0].seq.masks.keys()
        for layer in layers:
            masks = [e.seq.masks[layer][1] for e in engines if layer in e.seq.masks]
            union.append(float(torch.stack([m.any(0) for m in masks]).any(0).float().mean()))
        for e in engines:
            e.seq.masks.clear()
    rate = computed / total if total else 1.0
    union_rate = sum(union) / len(union) if union else 1.0
    return seconds, rate, union_rate, (head_rows[0] / head_rows[1] if head_rows[1] else 1.0)


def run_bench(
    path,
    *,
    n_prompt=512,
    n_gen=128,
    repetitions=3,
    threads=None,
    device="auto",
    vram_budget=None,
    mode="both",
    batches=(1,),
    sparsity=None,
    depths=(0,),
    decoder="auto",
    head_screen=True,
    ram_budget=None,
):
    """Rows of results. On the CPU the modes are interleaved run by run (weights are mapped once, so both
    models cost nothing extra); on a GPU each mode is loaded, measured and freed in turn, with the same
    budget, so the two never compete for VRAM."""
    import hotcold
    from hotcold.loader import resolve_device
    from hotcold.placement.budget import GIB, default_budget_bytes

    on_gpu = resolve_device(device) == "cuda"
    if on_gpu and vram_budget is None:
        vram_budget = default_budget_bytes() / GIB  # one figure for both modes
    ctx = max(n_prompt, max(depths) + n_gen) + 2

    def load(m):
        return hotcold.load(
            path,
            threads=threads,
            device=device,
            vram_budget=vram_budget,
            dense=m == "dense",
            ctx_size=ctx,
            sparsity=sparsity if m == "sparse" else None,
            kv_sequences=max(batches),  # -b B holds B caches at once, as a server's slots do
            decoder=decoder,
            head_screen=head_screen,
            ram_budget=ram_budget,
        )

    first = load("sparse")
    if (longest := max(n_prompt, max(depths) + n_gen) + 1) > first.config.n_ctx_train:
        print(f"hotcold: warning: {context_warning(longest, first.config.n_ctx_train)}", file=sys.stderr)
    modes = (
        ["dense"]
        if not (first.config.sparse or first.config.sparsified)
        else {"both": ["sparse", "dense"], "sparse": ["sparse"], "dense": ["dense"]}[mode]
    )
    mf = first.loaded.file
    sizes = weight_bytes(mf)
    head = first.loaded.model.head if hasattr(first.loaded.model, "head") else None
    head_bytes = mf.tensors[
        names.tensor(names.OUTPUT if names.tensor(names.OUTPUT) in mf.tensors else names.TOKEN_EMBD)
    ].n_bytes
    screen_bytes = head.screen.nbytes if head is not None and head.screen is not None else 0
    file_size = mf.path.stat().st_size
    n_params = sum(math.prod(e.shape) for e in mf.tensors.values())
    tests = [("pp", n_prompt, 0)] if n_prompt > 0 else []  # (test, tokens, context depth)
    tests += [("tg", n_gen, d) for d in depths] if n_gen > 0 and 1 in batches else []
    tests += [(f"tgx{b}", n_gen, 0) for b in batches if b > 1 and n_gen > 0]
    samples = {(m, t): [] for m in modes for t in tests}
    rates = {(m, t): [] for m in modes for t in tests}
    head_share = {(m, t): [] for m in modes for t in tests}  # output-head rows computed / rows, a decode step
    unions = {(m, t): [] for m in modes for t in tests}
    stored = {(m, t): [] for m in modes for t in tests}  # bytes read from the file a token (--ram-budget)

    def one(llm, test, n, depth=0):
        """tokens/s, firing rate, union firing rate, share of the output head's rows computed a step"""
        if test.startswith("tgx"):
            b = int(test[3:])
            seconds, rate, union, share = measure_batch(llm, n, b)
            return b * n / seconds, rate, union, share
        seconds, rate, share = measure(llm, test, n, depth)
        return n / seconds, rate, rate, share

    groups = [[m] for m in modes] if on_gpu else [modes]
    decoder_of: dict[str, str] = {}
    for group in groups:
        has_sparse = first.config.sparse or first.config.sparsified
        models = {m: first if m == "sparse" and has_sparse else load(m) for m in group}
        for t in tests:
            test, n, depth = t
            for m in group:  # warm-up: page in the weights, compile kernels (a depth's prefill is not needed)
                one(models[m], test, min(n, 8))
            for _ in range(repetitions):  # interleaved so machine noise hits both modes alike
                for m in group:
                    stats = models[m].loaded.model.storage_stats
                    before = stats.snapshot() if stats is not None else None
                    tps, rate, union, share = one(models[m], test, n, depth)
                    head_share[m, t].append(share)
                    if stats is not None:
                        after = stats.snapshot()
                        read = after["bytes_read"] - before["bytes_read"]
                        stored[m, t].append(read / max(1, after["tokens"] - before["tokens"]))
                    samples[m, t].append(tps)
                    rates[m, t].append(rate)
                    unions[m, t].append(union)
        device_name = first.loaded.device
        decoder_of.update(
            {m: models[m].decoder for m in group}
        )  # after the runs: "eager" if a fast one failed
        del models
        first = None
        if on_gpu:
            torch.cuda.empty_cache()
    rows = []
    for t in tests:
        test, n, depth = t
        for m in modes:
            tps = statistics.median(samples[m, t])
            rate = statistics.mean(rates[m, t]) if m == "sparse" else 1.0
            union = statistics.mean(unions[m, t]) if m == "sparse" else 1.0
            batch = int(test[3:]) if test.startswith("tgx") else 1
            # a decode step reads every needed weight once, for the whole batch (the union of fired rows); a
            # screened head step reads the screen and the rows that can win instead of the whole head
            share = statistics.mean(head_share[m, t])
            head_read = head_bytes if share >= 1.0 else screen_bytes + head_bytes * share
            bytes_per_step = (
                sizes["other"] - head_bytes + head_read + sizes["ffn"] * union
                + (sizes["predictor"] if m == "sparse" else 0)
            )  # fmt: skip
            rows.append(
                {
                    "model": mf.path.name,
                    "size_bytes": file_size,
                    "params": n_params,
                    "mode": m,
                    "test": f"tg{n}x{batch}" if batch > 1 else f"tg{n} @ d{depth}" if depth else f"{test}{n}",
                    "batch": batch,
                    "depth": depth,  # context tokens before the timed decode (tg)
                    "tokens_per_s": tps,  # aggregate over the batch
                    "tokens_per_s_per_sequence": tps / batch,
                    "tokens_per_s_all": samples[m, t],
                    "firing_rate": rate,
                    "head_rows_share": share,
                    "storage_bytes_per_token": statistics.mean(stored[m, t])
                    if stored[m, t]
                    else None,  # output-head rows computed per step / vocabulary (1: the whole head)
                    "union_firing_rate": union,
                    # decode reads every needed weight once per step; prefill reuses them across the prompt
                    # (the KV cache a deep context adds is not counted: these are the weights' bytes)
                    "effective_gb_s": tps / batch * bytes_per_step / 1e9 if test.startswith("tg") else None,
                    "threads": threads or torch.get_num_threads(),
                    "device": device_name,
                    "decoder": decoder_of[
                        m
                    ],  # "eager", "cpu_one_call" or "cuda_graph" (hotcold.runtime.decoders)
                }
            )
    return rows


def context_warning(positions: int, n_ctx_train: int) -> str:
    return (
        f"the test runs {positions} positions, past the model's training context of {n_ctx_train} tokens: "
        "output there is out of distribution, and the timings are of a context the model is not meant for"
    )


def thread_counts(text: str | None) -> list[int | None]:
    """-t: one count, or comma-separated counts (each checked as --threads is everywhere)."""
    from hotcold import validate

    if text is None:
        return [None]
    out = []
    for part in text.split(","):
        try:
            value = int(part)
        except ValueError:
            raise ValueError(
                f"-t/--threads must be an integer >= 1 or comma-separated integers (1,2), got {text!r}"
            ) from None
        out.append(validate.check("threads", value, label="-t/--threads"))
        if warning := validate.threads_warning(value, "-t/--threads"):
            print(f"hotcold: warning: {warning}", file=sys.stderr)
    return out


def run(args) -> int:
    if args.n_prompt < 0 or args.n_gen < 0 or args.repetitions < 1:
        raise ValueError("-p and -n must be >= 0 and -r >= 1")
    try:
        if min(int(b) for b in args.batch.split(",")) < 1:
            raise ValueError
    except ValueError:
        raise ValueError(f"-b/--batch must be comma-separated sizes >= 1, got {args.batch!r}") from None
    counts = thread_counts(args.thread_counts)
    try:
        depths = [int(d) for d in args.n_depth.split(",")]
        if min(depths) < 0:
            raise ValueError
    except ValueError:
        raise ValueError(f"-d/--n-depth must be comma-separated depths >= 0, got {args.n_depth!r}") from None
    if args.plot is not None:  # a missing extra or a bad name fails before the measurements
        from hotcold import plots

        plots.require()
        plots.check_png(args.plot, [args.model] if args.model else [])
    rows = []
    for threads in counts:
        rows += run_bench(
            args.model,
            n_prompt=args.n_prompt,
            n_gen=args.n_gen,
            repetitions=args.repetitions,
            threads=threads,
            device=args.device,
            vram_budget=args.vram_budget,
            mode=args.mode,
            batches=[int(b) for b in args.batch.split(",")],
            sparsity=args.sparsity,
            depths=depths,
            decoder=args.decoder,
            head_screen=args.head_screen,
            ram_budget=args.ram_budget,
        )
    if args.plot is not None:
        from hotcold import plots

        title = f"{rows[0]['model']}: tokens/s on {rows[0]['device']}" if rows else None
        plots.plot_bench(rows, args.plot, title=title, inputs=[args.model] if args.model else [])
        print(f"hotcold: wrote {args.plot}", file=sys.stderr)
    if args.json:
        json.dump(rows, sys.stdout, indent=2)
        print()
        return 0
    header = f"| {'model':30s} | {'size':>9s} | {'params':>8s} | {'mode':6s} | {'test':12s} | {'t/s':>9s} | {'GB/s':>6s} | {'firing':>6s} | {'union':>6s} |"
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for r in rows:
        gbs = f"{r['effective_gb_s']:.1f}" if r["effective_gb_s"] is not None else "-"
        print(
            f"| {r['model'][:30]:30s} | {r['size_bytes'] / 2**30:7.2f} G | {r['params'] / 1e6:7.1f}M | {r['mode']:6s} | {r['test']:12s}"
            f" | {r['tokens_per_s']:9.2f} | {gbs:>6s} | {100 * r['firing_rate']:5.1f}% | {100 * r['union_firing_rate']:5.1f}% |"
        )
    for line in sparse_over_dense(rows):
        print(line)
    return 0


def sparse_over_dense(rows: list[dict]) -> list[str]:
    """One line per test that ran sparse and dense at the same thread count: the sparse rate over the dense one,
    with the sparse run's union firing rate (for a batch, the share of neurons any of its tokens fired: the rows
    a step reads)."""
    dense = {(r["test"], r["threads"]): r for r in rows if r["mode"] == "dense"}
    lines = []
    for r in rows:
        d = dense.get((r["test"], r["threads"]))
        if r["mode"] != "sparse" or d is None or not d["tokens_per_s"]:
            continue
        lines.append(
            f"{r['test']}, {r['threads']} thread(s): sparse / dense {r['tokens_per_s'] / d['tokens_per_s']:.2f}x"
            f" (sparse firing {100 * r['firing_rate']:.1f}% a token, union {100 * r['union_firing_rate']:.1f}%)"
        )
    return lines
