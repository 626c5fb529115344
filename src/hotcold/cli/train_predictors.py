"""hotcold train-predictors (HF_DIR | -m MODEL) -f corpus.txt -o PREDICTOR_DIR"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path


def add_args(p) -> None:
    p.add_argument("hf_dir", nargs="?", default=None, help="Hugging Face checkpoint folder of a ReLU model")
    p.add_argument("-m", "--model", default=None, help="or a dense / PowerInfer .gguf model file")
    p.add_argument("-f", "--file", required=True, help="training corpus: a UTF-8 text file")
    p.add_argument(
        "-o",
        "--output",
        required=True,
        help="predictor folder to write (model_{i}.pt, config.json), replaced as a whole when every layer is "
        "done; layers it already holds are kept",
    )
    p.add_argument("--rank", type=int, default=None, help="one fixed predictor rank (default: a ladder)")
    p.add_argument(
        "--ranks", default=None, help="comma-separated rank ladder, smallest first (default 64,128,256,512)"
    )
    p.add_argument(
        "--recall", type=float, default=0.99, help="recall target on held-out tokens (default 0.99)"
    )
    p.add_argument(
        "--max-selection",
        type=float,
        default=1.5,
        help="a rank is enough when it selects at most this many times the truly firing neurons (default 1.5)",
    )
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=256, help="tokens per training step")
    p.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate (cosine decay)")
    p.add_argument(
        "--pos-weight", type=float, default=None, help="BCE weight of firing neurons (default: auto)"
    )
    p.add_argument("--max-tokens", type=int, default=None, help="use at most this many corpus tokens")
    p.add_argument("-c", "--ctx-size", type=int, default=None, help="window length in tokens (default 512)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="where predictors train")
    p.add_argument("--seed", type=int, default=0)


def run(args) -> int:
    import hotcold
    from hotcold.placement.profile import corpus_tokens, read_corpus
    from hotcold.training.predictors import DEFAULT_RANKS, TrainConfig, train_predictors

    if (args.hf_dir is None) == (args.model is None):
        raise ValueError("give exactly one model: a Hugging Face folder (HF_DIR) or -m MODEL.gguf")
    if args.rank is not None and args.ranks is not None:
        raise ValueError("--rank and --ranks exclude each other")
    if args.ranks is not None:
        try:
            ranks = tuple(int(r) for r in args.ranks.split(","))
        except ValueError:
            raise ValueError(
                f"--ranks {args.ranks!r}: expected comma-separated integers, e.g. 64,128"
            ) from None
    else:
        ranks = (args.rank,) if args.rank is not None else DEFAULT_RANKS
    config = TrainConfig(
        ranks=ranks,
        recall=args.recall,
        max_selection=args.max_selection,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        pos_weight=args.pos_weight,
        device=args.device,
        seed=args.seed,
    )
    text = read_corpus(args.file)  # fail on a bad corpus before the (slow) model preparation
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hotcold-train-") as tmp:
        model_path = args.model
        if args.hf_dir is not None:
            from hotcold.convert import convert

            # the simplest exact reference: the checkpoint as a dense f32 GGUF, run by hotcold itself
            model_path = convert(
                args.hf_dir, None, Path(tmp) / "dense-f32.gguf", outtype="f32", progress=True
            )
        llm = hotcold.load(model_path, threads=args.threads, device="cpu", dense=True, ctx_size=args.ctx_size)
        ids = corpus_tokens(llm.tokenizer, text, max_tokens=args.max_tokens, spread=True, source=args.file)
        inputs = [args.file]
        if args.hf_dir is not None:
            from hotcold.convert import input_files

            inputs += input_files(Path(args.hf_dir), None)
        summary = train_predictors(
            llm, ids, args.output, ctx=args.ctx_size, config=config, progress=True, inputs=inputs
        )
    for s in summary["layers"]:
        print(
            f"layer {s['layer']:3d}: rank {s['rank']:4d}  recall {s['recall']:.4f}  precision {s['precision']:.3f}"
            f"  selected {s['selection_ratio']:.2f}x firing  firing {100 * s['firing_rate']:.1f}%",
            file=sys.stderr,
        )
    print(
        f"hotcold: predictors for {len(summary['layers'])} layers in {args.output} "
        f"({time.perf_counter() - start:.0f} s; sparse_threshold {summary['sparse_threshold']})",
        file=sys.stderr,
    )
    return 0
