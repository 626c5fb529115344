"""Make the bundled demo model sparse and install it: predictors, PowerInfer GGUF, activation statistics.

Runs hotcold's own commands on the Hugging Face checkpoint that train_model.py wrote:

  1. hotcold train-predictors HF -f train.txt -o WORK/predictors   (resumable: finished layers are kept)
  2. hotcold convert HF WORK/predictors -o WORK/demo.powerinfer.gguf --outtype f16
  3. token_embd.weight re-stored as Q8_0 (see EMBEDDING_TYPE): the file must stay under 25 MB
  4. hotcold profile -m WORK/demo.powerinfer.gguf -f train.txt -o WORK/activation
  5. copies the model and activation files into src/hotcold/data/ (where hotcold.load() looks)
  6. hotcold perplexity on heldout.txt, sparse (with the dense pass beside it): WORK/perplexity.json

Example (about 15 minutes on 2 busy CPU cores):
  python scripts/demo_model/build_sparse.py --hf /work/demo_build/hf --corpus /work/demo_build/corpus \
      --work /work/demo_build/sparse --threads 1
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "src" / "hotcold" / "data"
MODEL_NAME = "demo.powerinfer.gguf"  # hotcold.loader.DEMO_MODEL_NAME
MODEL_TITLE = "hotcold demo (ReLU-LLaMA 12M, Bible text)"
MAX_BYTES = 25_000_000
# The token embedding is a lookup table (one row read per token): Q8_0 costs it nothing measurable and
# saves 2 MB, which keeps F16 weights + predictors + statistics under MAX_BYTES. Everything else stays F16.
EMBEDDING_TYPE = "Q8_0"


def hotcold(*args: str, threads: int | None) -> None:
    argv = [sys.executable, "-m", "hotcold", *args]
    if threads is not None and args[0] != "convert":
        argv += ["-t", str(threads)]
    print("+ hotcold " + " ".join(args), file=sys.stderr, flush=True)
    subprocess.run(argv, check=True)


def requantize_embedding(src: Path, dst: Path) -> None:
    """Copy a GGUF file with token_embd.weight stored as EMBEDDING_TYPE and general.name set to MODEL_TITLE
    (every other tensor and key as is)."""
    from gguf import GGMLQuantizationType

    from hotcold.gguf import quants
    from hotcold.gguf.io import ModelFile, TensorSpec, metadata_items, write_model_file

    mf = ModelFile(src)
    qtype = GGMLQuantizationType[EMBEDDING_TYPE]
    specs = []
    for e in mf.tensors.values():
        if e.name == "token_embd.weight":
            values = mf.tensor(e.name).float()
            specs.append(TensorSpec(e.name, e.shape, qtype, lambda v=values: quants.quantize(v, qtype)))
        else:
            specs.append(TensorSpec(e.name, e.shape, e.qtype, lambda e=e: e.data))
    meta = [(k, MODEL_TITLE if k == "general.name" else v, *rest) for k, v, *rest in metadata_items(mf)]
    write_model_file(dst, mf.architecture, meta, specs, sparse=mf.is_sparse)


def forget_stale_predictors(hf: Path, pred: Path) -> None:
    """train-predictors resumes from the layers it finds: drop them when the checkpoint changed since."""
    weights = sorted(hf.glob("*.safetensors"))
    if not weights:
        raise SystemExit(f"{hf}: no *.safetensors weights (is train_model.py finished?)")
    stamp = [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in weights]
    record = pred / "checkpoint.json"
    if pred.exists() and (not record.exists() or json.loads(record.read_text()) != stamp):
        print(f"{hf} changed since {pred} was trained: training again", file=sys.stderr)
        shutil.rmtree(pred)
    pred.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(stamp))


def install(model: Path, activation_dir: Path) -> int:
    """Copy into src/hotcold/data atomically (temp name + rename); returns the bytes installed."""
    DATA.mkdir(parents=True, exist_ok=True)
    act_out = DATA / "activation"
    act_out.mkdir(exist_ok=True)
    for old in act_out.glob("activation_*.pt"):
        old.unlink()
    pairs = [(model, DATA / MODEL_NAME)] + [
        (p, act_out / p.name) for p in sorted(activation_dir.glob("*.pt"))
    ]
    total = 0
    for src, dst in pairs:
        tmp = dst.with_name(f".{dst.name}.tmp")
        shutil.copyfile(src, tmp)
        tmp.replace(dst)
        total += dst.stat().st_size
    for stale in DATA.glob(MODEL_NAME + ".generated.gpuidx"):
        stale.unlink()  # placement of the previous model
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf", type=Path, required=True, help="Hugging Face checkpoint from train_model.py")
    ap.add_argument("--corpus", type=Path, required=True, help="folder with train.txt and heldout.txt")
    ap.add_argument("--work", type=Path, required=True, help="build folder (predictors, model, statistics)")
    ap.add_argument("--tokens", type=int, default=200_000, help="training tokens for predictors and profile")
    ap.add_argument("--ranks", default="64,96,128", help="predictor rank ladder")
    ap.add_argument("--recall", type=float, default=0.99, help="per-layer recall target on held-out tokens")
    ap.add_argument("--max-selection", type=float, default=1.4, help="per-layer bound on selected / firing")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-install", action="store_true", help="build in --work only")
    ap.add_argument("--retrain", action="store_true", help="train every predictor again (default: resume)")
    args = ap.parse_args()

    train, heldout = args.corpus / "train.txt", args.corpus / "heldout.txt"
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    pred, f16, model, act = work / "predictors", work / "f16.gguf", work / MODEL_NAME, work / "activation"
    timings = {}
    if args.retrain and pred.exists():
        shutil.rmtree(pred)
    forget_stale_predictors(args.hf, pred)

    start = time.perf_counter()
    hotcold(
        "train-predictors", str(args.hf), "-f", str(train), "-o", str(pred), "--max-tokens", str(args.tokens),
        "--ranks", args.ranks, "--recall", str(args.recall), "--max-selection", str(args.max_selection),
        "--epochs", str(args.epochs), threads=args.threads,
    )  # fmt: skip
    timings["train_predictors_s"] = time.perf_counter() - start

    start = time.perf_counter()
    hotcold("convert", str(args.hf), str(pred), "-o", str(f16), "--outtype", "f16", threads=None)
    requantize_embedding(f16, model)
    f16.unlink()
    timings["convert_s"] = time.perf_counter() - start

    start = time.perf_counter()
    hotcold(
        "profile", "-m", str(model), "-f", str(train), "-o", str(act), "--max-tokens", str(args.tokens),
        threads=args.threads,
    )  # fmt: skip
    timings["profile_s"] = time.perf_counter() - start

    size = model.stat().st_size + sum(p.stat().st_size for p in act.glob("*.pt"))
    print(f"model + statistics: {size:,} bytes", file=sys.stderr)
    if size > MAX_BYTES:
        raise SystemExit(f"{size:,} bytes is over the {MAX_BYTES:,}-byte budget for the bundled model")
    if not args.no_install:
        installed = install(model, act)
        print(f"installed {installed:,} bytes in {DATA}", file=sys.stderr)

    start = time.perf_counter()
    result = work / "perplexity.json"
    with open(result, "w") as out:
        argv = [sys.executable, "-m", "hotcold", "perplexity", "-m", str(model), "-f", str(heldout), "--json"]
        if args.threads is not None:
            argv += ["-t", str(args.threads)]
        subprocess.run(argv, check=True, stdout=out)
    timings["perplexity_s"] = time.perf_counter() - start
    figures = json.loads(result.read_text())
    print(
        f"held-out perplexity: sparse {figures['perplexity']:.3f}, dense {figures['dense_perplexity']:.3f} "
        f"({100 * figures['perplexity_increase']:+.2f}%); recall {figures['recall_mean']:.4f}, "
        f"selected {figures['selection_ratio']:.2f}x firing; computed {100 * figures['firing_rate']:.1f}% of neurons",
        file=sys.stderr,
    )
    print(json.dumps({k: round(v, 1) for k, v in timings.items()}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
