"""hotcold generate: text on stdout, timings on stderr."""

from __future__ import annotations

import sys

from hotcold.cli import add_model_args, load_from_args


def add_args(p) -> None:
    add_model_args(p)
    p.add_argument("-p", "--prompt", default=None, help="prompt text")
    p.add_argument(
        "-f",
        "--file",
        default=None,
        help="read the prompt from a file (neither -p nor -f: from a piped stdin)",
    )
    p.add_argument("-n", "--n-predict", type=int, default=128, help="tokens to generate")
    add_sampling_args(p)
    p.add_argument("--echo", action="store_true", help="print the prompt before the generated text")
    p.add_argument("--ignore-eos", action="store_true", help="always generate n-predict tokens")
    p.add_argument(
        "--json-schema", default=None, metavar="FILE", help="constrain the output to this JSON schema"
    )
    p.add_argument(
        "--grammar", default=None, metavar="FILE", help="constrain the output to this grammar (GBNF or Lark)"
    )


def add_sampling_args(p) -> None:
    """The sampler's flags, as llama.cpp names them (generate and run)."""
    p.add_argument("--temp", type=float, default=0.8, help="temperature (0: greedy)")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--repeat-penalty", type=float, default=1.1)
    p.add_argument("--seed", type=int, default=None, help="random seed in [0, 2**64) (default: random)")


def sampling_kwargs(args) -> dict:
    return dict(
        temperature=args.temp, top_k=args.top_k or None, top_p=args.top_p, min_p=args.min_p,
        repeat_penalty=args.repeat_penalty, seed=args.seed,
    )  # fmt: skip


def piped_stdin() -> str | None:
    """The text piped or redirected into stdin (`echo hi | hotcold generate`), or None: a terminal, /dev/null,
    or no stdin at all (as under pytest) is not a prompt. Only a pipe or a file is read, so an inherited
    terminal never blocks the command."""
    import os
    import stat

    try:
        mode = os.fstat(sys.stdin.fileno()).st_mode
    except (AttributeError, OSError, ValueError):  # closed, or replaced by an object without a descriptor
        return None
    if not (stat.S_ISFIFO(mode) or stat.S_ISREG(mode)):
        return None
    text = sys.stdin.read()
    return text if text.strip() else None


def run(args) -> int:
    if args.file is not None:
        from hotcold.validate import read_text_file

        prompt = read_text_file(args.file, "the prompt file, -f/--file")
    elif args.prompt is not None:
        prompt = args.prompt
    else:
        prompt = piped_stdin() or "Once upon a time"
    constrain = _constraint_args(args)  # a bad schema or grammar fails before the model loads
    llm = load_from_args(args)
    for note in llm.loaded.notes:
        print(f"hotcold: {note}", file=sys.stderr)
    if args.echo:
        sys.stdout.write(prompt)
    for text in llm.stream(
        prompt,
        max_tokens=args.n_predict,
        **sampling_kwargs(args),
        ignore_eos=args.ignore_eos,
        **constrain,
    ):
        sys.stdout.write(text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    s = llm.last_stats
    print(
        f"hotcold: load {llm.load_seconds * 1000:.0f} ms | prompt {s.prompt_tokens} tokens, {s.prompt_tps:.1f} tokens/s"
        f" | generation {s.generated_tokens} tokens, {s.generate_tps:.1f} tokens/s"
        f" | FFN neurons computed {100 * s.firing_rate:.1f}%" + _storage_text(s),
        file=sys.stderr,
    )
    return 0


def _storage_text(stats) -> str:
    """Under a RAM budget: what the request read from the model file and the neuron cache's hit rate."""
    if not getattr(stats, "storage", None):
        return ""
    from hotcold.server.figures import storage_timings

    f = storage_timings([stats])
    hit = f["neuron_cache_hit_rate"]
    rate = "-" if hit is None else f"{100 * hit:.1f}%"
    return f" | storage {f['storage_bytes_per_token'] / 2**20:.2f} MiB/token read, neuron cache hits {rate}"


def _constraint_args(args) -> dict:
    from hotcold.structured import compile_constraint
    from hotcold.validate import read_text_file

    out = {}
    if args.json_schema is not None:
        out["json_schema"] = read_text_file(args.json_schema, "the JSON schema, --json-schema")
    if args.grammar is not None:
        out["grammar"] = read_text_file(args.grammar, "the grammar, --grammar")
    if out:
        flag = "--json-schema" if "json_schema" in out else "--grammar"
        compile_constraint(field=f"{flag} {args.json_schema or args.grammar}", **out)
    return out
