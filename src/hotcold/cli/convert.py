"""hotcold convert HF_DIR [PREDICTOR_DIR] -o OUT.gguf"""

from __future__ import annotations

import sys


def add_args(p) -> None:
    p.add_argument("hf_dir", help="Hugging Face checkpoint folder (config.json, safetensors, tokenizer)")
    p.add_argument(
        "predictor_dir", nargs="?", default=None, help="PowerInfer predictor folder (model_{i}.pt)"
    )
    p.add_argument("-o", "--outfile", required=True, help="output .gguf path")
    p.add_argument("--outtype", default="f16", choices=("f32", "f16", "bf16", "q8_0", "q4_0"))
    p.add_argument(
        "--dense", action="store_true", help="write the dense layout even when predictors are given"
    )


def run(args) -> int:
    from hotcold.convert import convert

    out = convert(
        args.hf_dir, args.predictor_dir, args.outfile, outtype=args.outtype, dense=args.dense, progress=True
    )
    print(f"hotcold: wrote {out}", file=sys.stderr)
    return 0
