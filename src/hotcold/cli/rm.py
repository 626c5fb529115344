"""hotcold rm: remove a pulled model from the Hugging Face cache (ORG/REPO: all of it; ORG/REPO:TAG: that file)."""

from __future__ import annotations


def add_args(p) -> None:
    p.add_argument("name", help="ORG/REPO (every file) or ORG/REPO:TAG (the files of one tag)")


def run(args) -> int:
    from hotcold import hub

    for path in hub.remove(args.name):
        print(f"removed {path}")
    return 0
