"""Checks of what people give us: numbers (CLI flags, API arguments, request fields) and text files.

One table of rules, `RULES`, keyed by field name, so the CLI, the Python API and the server refuse the same
values with the same message: `check("seed", value)` returns the value or raises ValueError naming the
field and the allowed range. The CLI maps its flags onto these fields (hotcold.cli.ARG_FIELDS).
NaN and infinities are refused wherever a finite number is meant; booleans are not numbers.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from numbers import Integral, Real
from pathlib import Path
from typing import Any

SEED_LIMIT = 2**64  # seeds are 64-bit: [0, 2**64)
MAX_VRAM_GIB = 2.0**20  # 1 PiB: far above any GPU, far below what overflows a u64 byte count


@dataclass(frozen=True)
class Rule:
    kind: type  # int or float
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False  # lo itself excluded
    hi_open: bool = False

    def describe(self, *, with_type: bool = True) -> str:
        """The rule in words; with_type=False leaves out "an integer" (for a value of the right type)."""
        what = ("an integer" if self.kind is int else "a finite number") if with_type else ""
        if self.lo is not None and self.hi is not None:
            left, right = "(" if self.lo_open else "[", ")" if self.hi_open else "]"
            return f"{what} in {left}{_fmt(self.lo)}, {_fmt(self.hi)}{right}".strip()
        if self.lo is not None:
            return f"{what} {'>' if self.lo_open else '>='} {_fmt(self.lo)}".strip()
        if self.hi is not None:
            return f"{what} {'<' if self.hi_open else '<='} {_fmt(self.hi)}".strip()
        return what or "a number"


def _fmt(x: float) -> str:
    if x == SEED_LIMIT:
        return "2**64"
    return str(int(x)) if float(x).is_integer() else str(x)


RULES: dict[str, Rule] = {
    # sampling
    "temperature": Rule(float, lo=0.0),
    "top_k": Rule(int, lo=0),
    "top_p": Rule(float, lo=0.0, hi=1.0, lo_open=True),
    "min_p": Rule(float, lo=0.0, hi=1.0),
    "repeat_penalty": Rule(float, lo=0.0, lo_open=True),
    "repeat_last_n": Rule(int, lo=0),
    "seed": Rule(int, lo=0, hi=SEED_LIMIT, hi_open=True),
    "max_tokens": Rule(int, lo=0),
    # loading and running
    "threads": Rule(int, lo=1),
    "ctx_size": Rule(int, lo=0),  # 0: the default (as llama.cpp's -c 0)
    "vram_budget": Rule(float, lo=0.0, hi=MAX_VRAM_GIB),
    "n_gpu_layers": Rule(int, lo=0),
    "batch_size": Rule(int, lo=1),
    "sparsity": Rule(float, lo=0.0, hi=1.0, hi_open=True),  # hotcold sparsify: share of FFN neurons skipped
    # corpora, benchmarks, training
    "corpus_tokens": Rule(int, lo=1),
    "n_prompt": Rule(int, lo=0),
    "n_gen": Rule(int, lo=0),
    "repetitions": Rule(int, lo=1),
    "rank": Rule(int, lo=1),
    "epochs": Rule(int, lo=1),
    "recall": Rule(float, lo=0.0, hi=1.0, lo_open=True),
    "max_selection": Rule(float, lo=0.0, lo_open=True),
    "learning_rate": Rule(float, lo=0.0, lo_open=True),
    "pos_weight": Rule(float, lo=0.0, lo_open=True),
}


def check(field: str, value: Any, *, label: str | None = None) -> Any:
    """`value` when it satisfies RULES[field], else ValueError "<label> must be <rule>, got <value>".

    Integers may come as floats with an integral value (JSON has one number type); they are returned as
    int. `label` names the field for the reader (e.g. "--seed"); default the field name."""
    rule = RULES[field]
    name = label or field
    bad = ValueError(f"{name} must be {rule.describe()}, got {value!r}")
    if isinstance(value, bool) or not isinstance(value, Real):
        raise bad
    if rule.kind is int:
        if not isinstance(value, Integral):
            if not (math.isfinite(value) and float(value).is_integer()):
                raise bad
        value = int(value)
        bad = ValueError(f"{name} must be {rule.describe(with_type=False)}, got {value!r}")
    else:
        try:
            value = float(value)
        except OverflowError:  # an integer past the float range
            raise bad from None
        if not math.isfinite(value):
            raise bad
    if rule.lo is not None and (value < rule.lo or (rule.lo_open and value == rule.lo)):
        raise bad
    if rule.hi is not None and (value > rule.hi or (rule.hi_open and value == rule.hi)):
        raise bad
    return value


def check_optional(field: str, value: Any, *, label: str | None = None) -> Any:
    return None if value is None else check(field, value, label=label)


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def threads_warning(threads: int, label: str = "threads") -> str | None:
    """A warning when more threads are asked for than there are cores to run them."""
    cores = available_cores()
    if threads > cores:
        return (
            f"{label} {threads} is more than the {cores} CPU core(s) available: the extra threads wait for "
            "each other at every step and make it slower; use at most the core count"
        )
    return None


def check_text(field: str, text: str) -> str:
    """Text that can be encoded as UTF-8: a lone surrogate (e.g. from a JSON "\\ud800" escape) is refused
    with its position."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{field}: character {exc.start} is a lone UTF-16 surrogate ({text[exc.start]!r}), not text"
        ) from None
    return text


def read_text_file(path: str | os.PathLike[str], what: str = "a text file") -> str:
    """The content of a UTF-8 text file; ValueError naming the file when it is missing, a folder, or not
    UTF-8 (with the byte offset of the first bad byte)."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path}: no such file ({what})")
    if path.is_dir():
        raise ValueError(f"{path}: is a folder, expected a UTF-8 text file ({what})")
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}: {data[exc.start : exc.start + 4]!r}); "
            "convert it to UTF-8 first (e.g. iconv -f LATIN1 -t UTF-8)"
        ) from None
