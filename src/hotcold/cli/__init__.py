"""`hotcold` console script: one module per subcommand (add_args + run), imported only when needed."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# subcommand -> (module under hotcold.cli, one-line help)
COMMANDS = {
    "generate": ("generate", "generate text from a prompt"),
    "run": ("run", "chat with a model in the terminal (pulled first when given by name)"),
    "pull": ("pull", "download a model by name (ORG/REPO[:TAG]) into the Hugging Face cache"),
    "list": ("list_models", "list the models pulled into the Hugging Face cache"),
    "rm": ("rm", "remove a pulled model (ORG/REPO, or ORG/REPO:TAG for one file) from the cache"),
    "info": ("info", "show a model's architecture, sizes, sparsity assets and placement"),
    "convert": ("convert", "convert a Hugging Face checkpoint (+ predictors) to GGUF / PowerInfer GGUF"),
    "quantize": (
        "quantize",
        "requantize a GGUF / PowerInfer file (llama.cpp's types: q4_k_m, q5_k_m, q6_k, q8_0, q4_0, ...)",
    ),
    "reorder": (
        "reorder",
        "rewrite a PowerInfer file with each layer's FFN neurons hottest first (faster CPU decode)",
    ),
    "place": ("place", "solve the hot-neuron placement for a VRAM budget (writes .generated.gpuidx)"),
    "bench": ("bench", "llama-bench-like speed table: prompt processing and generation, sparse vs dense"),
    "serve": ("serve", "OpenAI-compatible HTTP server with a chat page at /"),
    "profile": ("profile", "count how often each FFN neuron fires on a corpus -> activation_{i}.pt"),
    "train-predictors": (
        "train_predictors",
        "train per-layer predictors (which neurons fire) for a ReLU model",
    ),
    "perplexity": ("perplexity", "perplexity over a text; sparse mode adds predictor recall and precision"),
    "sparsify": (
        "sparsify",
        "make a dense SwiGLU model sparse without training: calibrate per-layer thresholds on a corpus",
    ),
}


# parsed argument (dest) -> (rule in hotcold.validate.RULES, the flag as people type it): every command's
# numeric flags are checked by the same rules as the API and the server, before the command runs
ARG_FIELDS = {
    "threads": ("threads", "-t/--threads"),
    "ctx_size": ("ctx_size", "-c/--ctx-size"),
    "vram_budget": ("vram_budget", "--vram-budget"),
    "ram_budget": ("vram_budget", "--ram-budget"),  # the same rule: a finite number >= 0
    "n_gpu_layers": ("n_gpu_layers", "-ngl/--n-gpu-layers"),
    "n_predict": ("max_tokens", "-n/--n-predict"),
    "temp": ("temperature", "--temp"),
    "top_k": ("top_k", "--top-k"),
    "top_p": ("top_p", "--top-p"),
    "min_p": ("min_p", "--min-p"),
    "repeat_penalty": ("repeat_penalty", "--repeat-penalty"),
    "seed": ("seed", "--seed"),
    "max_tokens": ("corpus_tokens", "--max-tokens"),
    "n_prompt": ("n_prompt", "-p/--n-prompt"),
    "n_gen": ("n_gen", "-n/--n-gen"),
    "repetitions": ("repetitions", "-r/--repetitions"),
    "rank": ("rank", "--rank"),
    "epochs": ("epochs", "--epochs"),
    "batch_size": ("batch_size", "--batch-size"),
    "recall": ("recall", "--recall"),
    "max_selection": ("max_selection", "--max-selection"),
    "lr": ("learning_rate", "--lr"),
    "pos_weight": ("pos_weight", "--pos-weight"),
    "sparsity": ("sparsity", "--sparsity"),
}


def validate_args(args: argparse.Namespace) -> None:
    """Check every numeric flag the command has against validate.RULES (ValueError naming the flag), and
    warn on stderr about more threads than cores."""
    from hotcold import validate

    for dest, (field, flag) in ARG_FIELDS.items():
        value = getattr(args, dest, None)
        if value is not None:
            setattr(args, dest, validate.check(field, value, label=flag))
    threads = getattr(args, "threads", None)
    if threads is not None and (warning := validate.threads_warning(threads, "-t/--threads")):
        print(f"hotcold: warning: {warning}", file=sys.stderr)


MODEL_HELP = "model file (.gguf), or a name ORG/REPO[:TAG] pulled from the Hugging Face Hub; omitted: the bundled demo model"


def add_model_args(parser: argparse.ArgumentParser, *, positional: bool = False) -> None:
    """Flags every model-running command shares, named as llama.cpp / PowerInfer name them (`positional`: the
    model is the command's argument, as in `hotcold run ORG/REPO`, instead of -m)."""
    if positional:
        parser.add_argument("model", nargs="?", default=None, help=MODEL_HELP)
    else:
        parser.add_argument("-m", "--model", default=None, help=MODEL_HELP)
    parser.add_argument("-t", "--threads", type=int, default=None, help="CPU threads")
    parser.add_argument("-c", "--ctx-size", type=int, default=None, help="context size in tokens")
    parser.add_argument("--vram-budget", type=float, default=None, help="GiB of VRAM to use (0: CPU only)")
    parser.add_argument(
        "--ram-budget",
        type=float,
        default=None,
        help="GiB of RAM for the model (sparse files, CPU): hot neurons resident, cold ones read from the file",
    )
    parser.add_argument("--reset-gpu-index", action="store_true", help="re-solve the neuron placement")
    parser.add_argument("--disable-gpu-index", action="store_true", help="keep every FFN neuron on the CPU")
    parser.add_argument(
        "-ngl", "--n-gpu-layers", type=int, default=None, help="layers to offload (dense files)"
    )
    parser.add_argument("--dense", action="store_true", help="compute every neuron (ignore predictors)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument(
        "--decoder",
        choices=("auto", "eager"),
        default="auto",
        help="decode steps: the fastest decoder the model allows (auto: a CUDA graph on one GPU, one C call a "
        "token on the CPU), or layer by layer (eager)",
    )
    parser.add_argument(
        "--no-head-screen",
        dest="head_screen",
        action="store_false",
        help="read the whole output head at every greedy step (default: a Q8_0 screen of a float head proves "
        "which rows can win and only those are computed; same tokens, 53%% of the head's bytes more memory)",
    )
    parser.add_argument(
        "--sparsity",
        type=float,
        default=None,
        help="`hotcold sparsify` files: share of FFN neurons (files written with --attention: and of attention "
        "input channels) to skip, in [0, 1) (default: the file's; 0: dense)",
    )


def load_from_args(args):
    """The model of a command's model flags (add_model_args), loaded with the options they make."""
    from hotcold.api import load_with
    from hotcold.load_options import LoadOptions

    return load_with(args.model, LoadOptions.from_args(args))


def build_parser(commands=COMMANDS) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hotcold", description="Fast local inference for activation-sparse LLMs."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the library does")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module, help_text) in commands.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(f"hotcold.cli.{module}").add_args(p)
        if any(action.dest == "model" for action in p._actions) and name != "pull":
            # every command that takes -m takes a model name, and so --offline (HF_HUB_OFFLINE=1 also works)
            p.add_argument(
                "--offline", action="store_true", help="use only models already in the cache: no network call"
            )
    return parser


def resolve_model_arg(args: argparse.Namespace) -> None:
    """A model name in -m (ORG/REPO[:TAG], hf.co/ORG/REPO[:TAG]) becomes the path of its file in the Hugging Face
    cache, pulled first if it is not there; `args.model_name` keeps what the user typed."""
    model = getattr(args, "model", None)
    args.model_name = model
    if model is None:
        return
    from hotcold import hub

    if hub.parse_name(model) is not None:
        args.model = str(hub.resolve(model, offline=getattr(args, "offline", False) or None))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # build only the chosen subcommand's parser when we can tell which it is: keeps startup fast
    chosen = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser({chosen: COMMANDS[chosen]} if chosen in COMMANDS else COMMANDS)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    module = importlib.import_module(f"hotcold.cli.{COMMANDS[args.command][0]}")
    try:
        validate_args(args)
        resolve_model_arg(args)
        return module.run(args) or 0
    except KeyboardInterrupt:
        print("\nhotcold: interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError, KeyError) as exc:
        # errors we raise name the file and the problem; no traceback for people
        if args.verbose:
            raise
        print(f"hotcold: error: {exc}", file=sys.stderr)
        return 1
    except RuntimeError as exc:  # from torch: out of memory, device trouble; one line unless -v
        if args.verbose:
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        hint = (
            " (try a lower --vram-budget)"
            if "out of memory" in first.lower()
            else " (run with -v for details)"
        )
        print(f"hotcold: error: {first}{hint}", file=sys.stderr)
        return 1
