"""hotcold pull: download a model by name into the Hugging Face cache (hotcold.hub says which files)."""

from __future__ import annotations

import sys


def add_args(p) -> None:
    p.add_argument("name", help="ORG/REPO[:TAG] or hf.co/ORG/REPO[:TAG] (TAG: a quantization such as Q4_K_M)")


def run(args) -> int:
    from hotcold import hub

    path = hub.pull(args.name)
    rows = [m for m in hub.list_models() if m.path == path]
    size = f", {rows[0].size / 2**30:.2f} GiB" if rows else ""
    print(f"hotcold: {args.name} is {path}{size}", file=sys.stderr)
    print(path)
    return 0
