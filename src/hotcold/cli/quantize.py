"""hotcold quantize IN.gguf OUT.gguf TYPE"""

from __future__ import annotations

import sys


def add_args(p) -> None:
    p.add_argument("input", help="model file to read (.gguf, dense or PowerInfer)")
    p.add_argument("output", help="file to write")
    p.add_argument("type", help="target type: f32, f16, bf16, q8_0, q4_0")


def run(args) -> int:
    from hotcold.convert.quantize import quantize_file

    out = quantize_file(args.input, args.output, args.type, progress=True)
    print(f"hotcold: wrote {out}", file=sys.stderr)
    return 0
