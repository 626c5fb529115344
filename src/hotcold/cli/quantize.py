"""hotcold quantize IN.gguf OUT.gguf TYPE"""

from __future__ import annotations

import sys

TYPE_HELP = (
    "target type, llama.cpp's names (case-insensitive): q4_k_m, q4_k_s, q5_k_m, q5_k_s, q6_k, q3_k_m, "
    "q3_k_s, q3_k_l, q2_k, q8_0, q4_0, q4_1, q5_0, q5_1, f16, bf16, f32 (q3_k, q4_k, q5_k: the _m mixes), "
    "mxfp4_moe (mixture-of-experts files: experts MXFP4, every other matrix Q8_0, as llama-quantize)"
)


def add_args(p) -> None:
    p.add_argument("input", help="model file to read (.gguf, dense or PowerInfer)")
    p.add_argument("output", help="file to write")
    p.add_argument("type", help=TYPE_HELP)
    p.add_argument(
        "--predictor-type",
        metavar="TYPE",
        help="type of a PowerInfer file's predictors (fc1, fc2): keep (their own, F32 as F16), f16, bf16, "
        "f32, q8_0, q6_k, q5_1, q5_0, q4_1 or q4_0 (default: q8_0 for a block-format target, which selects "
        "as F16 does; the original's quantize makes them q4_0 / q5_0, faster, a few points less recall)",
    )


def run(args) -> int:
    from pathlib import Path

    from hotcold.atomic import check_output
    from hotcold.convert.quantize import quantize_file, quantize_statistics

    check_output(args.output, [args.input], what="quantize: output")
    statistics = (
        quantize_statistics(Path(args.input), Path(args.output)) if Path(args.input).is_file() else None
    )
    out = quantize_file(
        args.input,
        args.output,
        args.type,
        predictor_type=args.predictor_type,
        progress=True,
        statistics=statistics,
    )
    print(f"hotcold: wrote {out}", file=sys.stderr)
    for line in statistics.describe() if statistics is not None else ():
        print(f"hotcold: {line}", file=sys.stderr)
    return 0
