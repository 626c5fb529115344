"""hotcold reorder IN.gguf OUT.gguf [--activation DIR]"""

from __future__ import annotations

import sys


def add_args(p) -> None:
    p.add_argument("input", help="PowerInfer model file to read (its statistics in its folder's activation/)")
    p.add_argument(
        "output", help="file to write, in another folder (its statistics go to that folder's activation/)"
    )
    p.add_argument(
        "--activation",
        metavar="DIR",
        help="the input's activation statistics (default: the input's folder/activation, as `hotcold profile` writes)",
    )


def run(args) -> int:
    from hotcold.convert.reorder import reorder_file
    from hotcold.placement.profile import default_activation_dir

    out = reorder_file(args.input, args.output, activation_dir=args.activation)
    print(
        f"hotcold: wrote {out} (FFN neurons hottest first) and its statistics in {default_activation_dir(out)}",
        file=sys.stderr,
    )
    return 0
