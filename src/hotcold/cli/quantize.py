"""hotcold quantize IN.gguf OUT.gguf TYPE"""

from __future__ import annotations

import sys

TYPE_HELP = (
    "target type, llama.cpp's names (case-insensitive): q4_k_m, q4_k_s, q5_k_m, q5_k_s, q6_k, q3_k_m, "
    "q3_k_s, q3_k_l, q2_k, q8_0, q4_0, q4_1, q5_0, q5_1, f16, bf16, f32 (q3_k, q4_k, q5_k: the _m mixes)"
)


def add_args(p) -> None:
    p.add_argument("input", help="model file to read (.gguf, dense or PowerInfer)")
    p.add_argument("output", help="file to write")
    p.add_argument("type", help=TYPE_HELP)


def run(args) -> int:
    from hotcold.convert.quantize import quantize_file

    out = quantize_file(args.input, args.output, args.type, progress=True)
    print(f"hotcold: wrote {out}", file=sys.stderr)
    return 0
