"""hotcold list: the models pulled into the Hugging Face cache (name, tag, size, path), as `ollama list`."""

from __future__ import annotations


def add_args(p) -> None:
    pass


def run(args) -> int:
    from hotcold import hub

    rows = hub.list_models()
    if not rows:
        print(f"no models pulled yet (cache: {hub.cache_dir()}); try `hotcold pull ORG/REPO:Q4_K_M`")
        return 0
    table = [("NAME", "TAG", "SIZE", "PATH")] + [
        (
            m.name,
            m.tag or "-",
            f"{m.size / 2**30:.2f} GiB" if m.size >= 2**30 else f"{m.size / 2**20:.1f} MiB",
            str(m.path),
        )
        for m in rows
    ]
    widths = [max(len(r[i]) for r in table) for i in range(3)]
    for r in table:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[3])
    return 0
