"""Build the demo model's training corpus from public-domain Bibles packaged by Debian.

Sources (both public domain, both install offline from the distribution mirror):

- King James Version, Debian packages ``bible-kjv`` + ``bible-kjv-text``. Read with
  ``bible -f 'gen1:1-rev22:21'`` (one verse a line, ``Ge1:1 In the beginning ...``); the verse
  references are stripped. The KJV text's copyright has expired; the packaging is GPL-2+.
- World English Bible (2015, with the deuterocanonical books), Debian packages
  ``sword-text-web`` + ``libsword-utils``. Read with ``mod2imp engWEB2015eb`` as raw OSIS markup
  (its ``-s`` strip mode glues words together at footnotes): footnotes, headings, Strong's tags and
  other markup are removed here, paragraphs and poetry lines become lines. Public domain.

Install them (as root) with::

    apt-get update && apt-get install -y bible-kjv bible-kjv-text sword-text-web libsword-utils

Layout of the output text: one document per book and translation; a document is its title line,
then its chapters separated by blank lines (KJV: one verse a line; WEB: one paragraph or poetry
line a line); documents are separated by two blank lines. Chapter and verse numbers are dropped and
curly quotes become ASCII quotes, so what a user types looks like the training text.

Train / held-out split by whole books, the same books in both translations (parallel texts would
otherwise leak): ``HELDOUT_BOOKS``. The files are written next to a ``manifest.json`` that lists
every document, its split and size.

Usage::

    python scripts/demo_model/prepare_corpus.py --out /work/demo_build/corpus
"""

from __future__ import annotations

import argparse
import html
import json
import os
import re
import subprocess
import sys
from pathlib import Path

# The 66 books in KJV order, named as the WEB module names them. `bible` prints its own
# abbreviations in the same order, so the KJV is matched to these names by position.
CANON = [
    "Genesis", "Exodus", "Leviticus", "Numbers", "Deuteronomy", "Joshua", "Judges", "Ruth",
    "I Samuel", "II Samuel", "I Kings", "II Kings", "I Chronicles", "II Chronicles", "Ezra",
    "Nehemiah", "Esther", "Job", "Psalms", "Proverbs", "Ecclesiastes", "Song of Solomon", "Isaiah",
    "Jeremiah", "Lamentations", "Ezekiel", "Daniel", "Hosea", "Joel", "Amos", "Obadiah", "Jonah",
    "Micah", "Nahum", "Habakkuk", "Zephaniah", "Haggai", "Zechariah", "Malachi",
    "Matthew", "Mark", "Luke", "John", "Acts", "Romans", "I Corinthians", "II Corinthians",
    "Galatians", "Ephesians", "Philippians", "Colossians", "I Thessalonians", "II Thessalonians",
    "I Timothy", "II Timothy", "Titus", "Philemon", "Hebrews", "James", "I Peter", "II Peter",
    "I John", "II John", "III John", "Jude", "Revelation of John",
]  # fmt: skip

# About 3% of the text. Tobit is WEB-only (deuterocanonical); none of these has a near-duplicate
# elsewhere in the corpus (Esther / "Esther (Greek)" and the synoptic gospels would).
HELDOUT_BOOKS = {"Ruth", "Ecclesiastes", "Jonah", "Galatians", "James", "Tobit"}

WEB_MODULE = "engWEB2015eb"

_QUOTES = str.maketrans({"\u201c": '"', "\u201d": '"', "\u2018": "'", "\u2019": "'"})


def tidy(text: str) -> str:
    """Collapse spaces, ASCII quotes, no space before closing punctuation, no empty lines."""
    text = text.translate(_QUOTES)
    lines = []
    for line in text.split("\n"):
        line = re.sub(r"[ \t\u00a0]+", " ", line).strip()
        line = re.sub(r" +([,.;:!?)\]])", r"\1", line)
        if line:
            lines.append(line)
    return "\n".join(lines)


# --- King James Version -----------------------------------------------------------------------

_KJV_VERSE = re.compile(r"^([1-3]?[A-Za-z]+)(\d+):(\d+) (.*)$")


def parse_kjv(listing: str) -> list[tuple[str, str]]:
    """`bible -f` output -> [(book name, text)], chapters separated by blank lines."""
    books: dict[str, dict[int, list[str]]] = {}
    order: list[str] = []
    for n, line in enumerate(listing.splitlines(), 1):
        if not line.strip():
            continue
        m = _KJV_VERSE.match(line)
        if m is None:
            raise ValueError(f"bible output line {n} is not 'BookC:V text': {line[:80]!r}")
        abbrev, chapter, verse = m.group(1), int(m.group(2)), m.group(4)
        if abbrev not in books:
            books[abbrev] = {}
            order.append(abbrev)
        books[abbrev].setdefault(chapter, []).append(verse)
    if len(order) != len(CANON):
        raise ValueError(f"bible printed {len(order)} books, expected {len(CANON)}: {order}")
    out = []
    for abbrev, name in zip(order, CANON):
        chapters = [tidy("\n".join(verses)) for _, verses in sorted(books[abbrev].items())]
        out.append((name, "\n\n".join(chapters)))
    return out


def read_kjv() -> list[tuple[str, str]]:
    listing = _run(["bible", "-f", "gen1:1-rev22:21"], package="bible-kjv bible-kjv-text")
    return parse_kjv(listing)


# --- World English Bible ----------------------------------------------------------------------

_WEB_KEY = re.compile(r"^\$\$\$(.*) (\d+):(\d+)$")
_DROP_WITH_CONTENT = [
    re.compile(r"<note\b.*?</note>", re.S),  # footnotes; a space, they sit between words
    re.compile(r"<title\b(?![^>]*canonical=\"true\")[^>]*>.*?</title>", re.S),  # headings
    re.compile(r"<speaker\b.*?</speaker>", re.S),  # "Beloved" labels in the Song of Solomon
    re.compile(r"<list\b.*?</list>", re.S),  # glossary entries
]
# A new line starts at a paragraph, a line break, or a poetry line / line group start.
_LINE_START = re.compile(
    r'<div\b[^>]*\bsID="[^"]*"[^>]*type="x-p"[^>]*/>|<lb\b[^>]*/>|<lg\b[^>]*\bsID="[^"]*"[^>]*/>'
    r'|<l\b[^>]*\bsID="[^"]*"[^>]*/>'
)
_BOOK_END = re.compile(r'<div\b[^>]*\btype="book"[^>]*/>')
_TAG = re.compile(r"<[^>]*>")


def clean_web_verse(markup: str) -> str:
    """One WEB verse record (OSIS markup) -> plain text; '\\n' where a paragraph or line starts."""
    end = _BOOK_END.search(markup)  # the last verse of a book can carry appendices (glossary)
    if end is not None:
        markup = markup[: end.start()]
    markup = markup.replace("\n", " ")
    for pattern in _DROP_WITH_CONTENT:
        markup = pattern.sub(" ", markup)
    markup = _LINE_START.sub("\n", markup)
    return html.unescape(_TAG.sub("", markup))


def parse_web(dump: str) -> list[tuple[str, str]]:
    """`mod2imp` output -> [(book name, text)] in module order, chapters separated by blank lines.

    Verse 0 records (book and chapter introductions, the translators' preface, and a duplicate
    Greek Daniel that the module files under "Hosea 0:0") are skipped.
    """
    books: dict[str, dict[int, list[str]]] = {}
    key = None
    for line in dump.split("\n"):
        if line.startswith("$$$"):
            m = _WEB_KEY.match(line)
            key = (m.group(1), int(m.group(2)), int(m.group(3))) if m else None
            if key is not None and key[2] > 0:
                books.setdefault(key[0], {}).setdefault(key[1], [])
            continue
        if key is None or key[2] == 0:
            continue
        books[key[0]][key[1]].append(clean_web_verse(line))
    missing = [name for name in CANON if name not in books]
    if missing:
        raise ValueError(f"mod2imp {WEB_MODULE}: books missing: {missing}")
    out = []
    for name, chapters in books.items():
        texts = [tidy(" ".join(verses)) for _, verses in sorted(chapters.items())]
        out.append((name, "\n\n".join(t for t in texts if t)))
    return out


def read_web() -> list[tuple[str, str]]:
    dump = _run(["mod2imp", WEB_MODULE], package="sword-text-web libsword-utils")
    return parse_web(dump)


# --- assembly ---------------------------------------------------------------------------------


def _run(cmd: list[str], *, package: str) -> str:
    try:
        result = subprocess.run(cmd, capture_output=True, check=True)
    except FileNotFoundError:
        sys.exit(f"{cmd[0]} not found: apt-get install -y {package}")
    except subprocess.CalledProcessError as e:
        sys.exit(f"{' '.join(cmd)} failed ({e.returncode}): {e.stderr.decode(errors='replace')[:500]}")
    return result.stdout.decode("utf-8")


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/work/demo_build/corpus"), help="output folder")
    args = ap.parse_args(argv)

    documents = [("kjv", name, text) for name, text in read_kjv()]
    documents += [("web", name, text) for name, text in read_web()]

    splits: dict[str, list[str]] = {"train": [], "heldout": []}
    manifest = []
    for source, name, text in documents:
        split = "heldout" if name in HELDOUT_BOOKS else "train"
        title = name.removesuffix(" of John")  # "Revelation of John" is titled "Revelation"
        splits[split].append(f"{title}\n\n{text}")
        manifest.append({"source": source, "book": name, "split": split, "chars": len(text)})

    args.out.mkdir(parents=True, exist_ok=True)
    for split, docs in splits.items():
        _write_atomic(args.out / f"{split}.txt", "\n\n\n".join(docs) + "\n")
    summary = {
        split: {"documents": len(docs), "chars": sum(len(d) for d in docs)} for split, docs in splits.items()
    }
    _write_atomic(
        args.out / "manifest.json",
        json.dumps(
            {"heldout_books": sorted(HELDOUT_BOOKS), "splits": summary, "documents": manifest}, indent=1
        )
        + "\n",
    )
    for split, s in summary.items():
        print(f"{args.out / (split + '.txt')}: {s['documents']} documents, {s['chars']:,} characters")


if __name__ == "__main__":
    main()
