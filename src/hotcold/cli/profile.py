"""hotcold profile: per-layer FFN activation counts on a corpus -> DIR/activation_{i}.pt; with --plot, a PNG
of their locality (hotcold.plots). `--plot` without `-f` plots the statistics already there."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from hotcold.cli import add_model_args


def add_args(p) -> None:
    add_model_args(p)
    p.add_argument(
        "-f", "--file", default=None, help="corpus: a UTF-8 text file (needed unless --plot only plots)"
    )
    p.add_argument(
        "-o",
        "--output",
        default=None,
        help="output folder (default: <model dir>/activation, where the loader looks; for the bundled model or "
        "one in a read-only folder: activation/ in the user cache, HOTCOLD_CACHE_DIR or ~/.cache/hotcold, where "
        "the loader looks too)",
    )
    p.add_argument("--max-tokens", type=int, default=None, help="profile at most this many corpus tokens")
    p.add_argument(
        "--plot",
        metavar="OUT.png",
        default=None,
        help="also draw the activation locality per layer (needs hotcold[plot]); without -f: plot the "
        "statistics already in the output folder",
    )


def run(args) -> int:
    import hotcold
    from hotcold.loader import demo_model_path
    from hotcold.placement.profile import (
        activation_output_dir,
        check_activation_dir,
        corpus_tokens,
        profile_activations,
        read_corpus,
        token_windows,
        window_ctx,
        write_activation_files,
    )

    if args.file is None:
        if args.plot is None:
            raise ValueError(
                "give a corpus (-f/--file), or --plot OUT.png to plot the statistics already made"
            )
        return plot_existing(args)
    if args.plot is not None:  # fail on a missing extra or a bad name before the long run
        from hotcold import plots

        plots.require()
        plots.check_png(args.plot, [args.file] + ([args.model] if args.model else []))
    text = read_corpus(args.file)  # fail on a bad corpus before loading the model
    model_file = Path(args.model) if args.model and Path(args.model).is_file() else None
    if args.model is None:
        model_file = demo_model_path()
    if args.output or model_file:  # a folder that cannot take the set is refused before the long run
        early = Path(args.output) if args.output else activation_output_dir(model_file)
        check_activation_dir(early, [args.file, *([model_file] if model_file else [])])
    start = time.perf_counter()
    llm = hotcold.load(
        args.model, threads=args.threads, device=args.device, dense=True, ctx_size=args.ctx_size
    )
    ctx = window_ctx(args.ctx_size, llm.config.n_ctx_train)
    ids = corpus_tokens(llm.tokenizer, text, max_tokens=args.max_tokens, spread=True, source=args.file)
    counts = profile_activations(llm, ids, ctx=ctx, progress=True)
    # never into the installed package (the bundled model) or a read-only folder: the user cache instead
    out_dir = args.output or activation_output_dir(llm.path)
    paths = write_activation_files(counts, out_dir, inputs=[llm.path, args.file])
    n_seen = sum(len(w) for w in token_windows(ids, ctx, llm.tokenizer.bos_id))  # BOS positions count too
    if llm.config.n_expert:  # routing counts: how uneven the routing is
        quarter = max(1, llm.config.n_expert // 4)
        shares = " ".join(f"{100 * c.sort(descending=True).values[:quarter].sum().item() / max(1, c.sum().item()):.1f}"
                          for c in counts)  # fmt: skip
        what = f"% of routings to each layer's {quarter} most used experts: {shares}"
    else:
        rates = " ".join(f"{100 * c.sum().item() / (c.numel() * n_seen):.1f}" for c in counts)
        what = f"% of neurons firing per token, by layer: {rates}"
    print(
        f"hotcold: profiled {len(ids)} tokens in {time.perf_counter() - start:.1f} s; {what}", file=sys.stderr
    )
    print(f"hotcold: wrote {len(paths)} files to {out_dir}", file=sys.stderr)
    if not args.output and Path(out_dir).parent != llm.path.parent:
        print(
            f"hotcold: {llm.path.parent} is the installed package or read-only, so the statistics went to the "
            "user cache; the loader, `place` and `info` use them from there",
            file=sys.stderr,
        )
    if args.plot is not None:
        _plot(counts, args.plot, n_tokens=n_seen, name=llm.path.name, inputs=[llm.path, args.file, *paths])
    return 0


def plot_existing(args) -> int:
    """--plot without a corpus: the statistics in the output folder (default: where the loader looks)."""
    from hotcold import plots
    from hotcold.config import config_from_file
    from hotcold.gguf.io import ModelFile
    from hotcold.loader import demo_model_path
    from hotcold.placement.profile import default_activation_dir, read_activation_files

    plots.require()
    path = Path(args.model) if args.model else demo_model_path()
    config = config_from_file(ModelFile(path))
    folder = Path(args.output) if args.output else default_activation_dir(path)
    counts = read_activation_files(folder, config.n_layer, config.n_expert or config.n_ff)  # MoE: per expert
    if counts is None:
        raise ValueError(
            f"no activation statistics in {folder}: run `hotcold profile -m {path} -f corpus.txt`"
        )
    files = [folder / f"activation_{i}.pt" for i in range(config.n_layer)]
    _plot(counts, args.plot, n_tokens=None, name=path.name, inputs=[path, *files])
    return 0


def _plot(counts, out, *, n_tokens, name, inputs) -> None:
    from hotcold import plots

    plots.plot_activations(
        counts, out, n_tokens=n_tokens, title=f"{name}: activation locality", inputs=inputs
    )
    shares = " ".join(f"{100 * plots.neurons_carrying(c):.1f}" for c in counts)
    print(f"hotcold: % of neurons carrying 80% of activations, by layer: {shares}", file=sys.stderr)
    print(f"hotcold: wrote {out}", file=sys.stderr)
