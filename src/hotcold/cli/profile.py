"""hotcold profile: per-layer FFN activation counts on a corpus -> DIR/activation_{i}.pt"""

from __future__ import annotations

import sys
import time

from hotcold.cli import add_model_args


def add_args(p) -> None:
    add_model_args(p)
    p.add_argument("-f", "--file", required=True, help="corpus: a UTF-8 text file")
    p.add_argument(
        "-o",
        "--output",
        default=None,
        help="output folder (default: <model dir>/activation, where the loader looks)",
    )
    p.add_argument("--max-tokens", type=int, default=None, help="profile at most this many corpus tokens")


def run(args) -> int:
    import hotcold
    from hotcold.placement.profile import (
        corpus_tokens,
        default_activation_dir,
        profile_activations,
        read_corpus,
        token_windows,
        window_ctx,
        write_activation_files,
    )

    text = read_corpus(args.file)  # fail on a bad corpus before loading the model
    start = time.perf_counter()
    llm = hotcold.load(
        args.model, threads=args.threads, device=args.device, dense=True, ctx_size=args.ctx_size
    )
    ctx = window_ctx(args.ctx_size, llm.config.n_ctx_train)
    ids = corpus_tokens(llm.tokenizer, text, max_tokens=args.max_tokens, spread=True, source=args.file)
    counts = profile_activations(llm, ids, ctx=ctx, progress=True)
    out_dir = args.output or default_activation_dir(llm.path)
    paths = write_activation_files(counts, out_dir, inputs=[llm.path, args.file])
    n_seen = sum(len(w) for w in token_windows(ids, ctx, llm.tokenizer.bos_id))  # BOS positions count too
    rates = " ".join(f"{100 * c.sum().item() / (c.numel() * n_seen):.1f}" for c in counts)
    print(
        f"hotcold: profiled {len(ids)} tokens in {time.perf_counter() - start:.1f} s; "
        f"% of neurons firing per token, by layer: {rates}",
        file=sys.stderr,
    )
    print(f"hotcold: wrote {len(paths)} files to {out_dir}", file=sys.stderr)
    return 0
