"""The C kernels' calling convention as ctypes sees it, read from `c/hotcold.h` (the one list of what Python
calls): the ABI version, a `ctypes.Structure` per struct and each function's argument and return types.

The header is written in a small form this module parses: `typedef struct [tag] { fields } name;` and one
prototype per statement, over the types in `_SCALARS` and the header's own structs. Written here rather than
with a C parser library (pycparser would need the system headers preprocessed) because the form is ours and
small; `hc_struct_size` lets the loader check every layout against the compiler's (`check_layouts`).

Pointers: a field or argument that points at one of the header's structs is typed (ctypes checks what is
passed); a struct field pointing at an array of such pointers is a pointer to pointers; every other pointer
(data, arrays of arrays, a function's `T *const *` arguments) is a `c_void_p`, given as an address.
"""

from __future__ import annotations

import ctypes
import re
from functools import cache
from pathlib import Path

HEADER = Path(__file__).with_name("c") / "hotcold.h"

_SCALARS = {
    "void": None,
    "int": ctypes.c_int,
    "int64_t": ctypes.c_int64,
    "int32_t": ctypes.c_int32,
    "uint8_t": ctypes.c_uint8,
    "float": ctypes.c_float,
    "double": ctypes.c_double,
    "char": ctypes.c_char,
}
STRUCT_SIZE_CODES = {"hc_weight": 0, "hc_in_rule": 1, "hc_layer": 2}  # hc_struct_size's argument


class HeaderError(ValueError):
    """c/hotcold.h holds something this module cannot bind (a type it does not know, a form it does not read)."""


def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))


def _declarator(decl: str) -> tuple[str, int, str, int | None]:
    """'const float *const *outs' -> ('float', 2, 'outs', None); 'int wts[3]' -> ('int', 0, 'wts', 3)."""
    m = re.fullmatch(r"\s*(?:const\s+)?(\w+)\s*((?:\*\s*(?:const\s*)?)*)(\w+)\s*(?:\[(\d+)\])?\s*", decl)
    if m is None:
        raise HeaderError(f"{HEADER.name}: cannot read the declaration {decl.strip()!r}")
    base, stars, name, n = m.groups()
    return base, stars.count("*"), name, None if n is None else int(n)


def _ctype(base: str, depth: int, structs: dict, *, field: bool):
    known = structs.get(base)
    if depth == 0:
        if base in _SCALARS:
            return _SCALARS[base]
        if known is not None:
            return known
        raise HeaderError(f"{HEADER.name}: unknown type {base!r}")
    if base not in _SCALARS and known is None:
        raise HeaderError(f"{HEADER.name}: unknown type {base!r}")
    if known is not None and depth == 1:
        return ctypes.POINTER(known)
    if known is not None and depth == 2 and field:
        return ctypes.POINTER(ctypes.POINTER(known))
    if base == "char" and depth == 1:
        return ctypes.c_char_p
    return ctypes.c_void_p


@cache
def parse(
    text: str | None = None,
) -> tuple[int, dict[str, type[ctypes.Structure]], dict[str, tuple[list, object]]]:
    """(ABI version, struct name -> ctypes.Structure, function name -> (argtypes, restype)) of the header."""
    raw = HEADER.read_text() if text is None else text
    abi = re.search(r"#define\s+HC_ABI_VERSION\s+(\d+)", raw)
    if abi is None:
        raise HeaderError(f"{HEADER.name}: no HC_ABI_VERSION")
    body = _strip_comments(raw)
    structs: dict[str, type[ctypes.Structure]] = {}
    for m in re.finditer(r"typedef\s+struct\s*\w*\s*\{(.*?)\}\s*(\w+)\s*;", body, flags=re.S):
        fields_text, name = m.groups()
        camel = "HC" + "".join(
            w.title() for w in name.removeprefix("hc_").split("_")
        )  # hc_in_rule -> HCInRule
        cls = type(camel, (ctypes.Structure,), {"__doc__": f"{name} in c/hotcold.h"})
        structs[name] = cls  # before its fields: a struct may point at its own type
        fields = []
        for stmt in filter(str.strip, fields_text.split(";")):
            first, *rest = stmt.split(",")
            qual = re.match(r"\s*(?:const\s+)?\w+\s*", first).group(0)
            for decl in [first, *(qual + r for r in rest)]:
                base, depth, fname, n = _declarator(decl)
                t = _ctype(base, depth, structs, field=True)
                fields.append((fname, t * n if n else t))
        cls._fields_ = fields
    body = re.sub(r"typedef\s+struct\s*\w*\s*\{.*?\}\s*\w+\s*;", " ", body, flags=re.S)
    functions: dict[str, tuple[list, object]] = {}
    for m in re.finditer(r"((?:const\s+)?\w+\s*\**)\s*(hc_\w+)\s*\(([^)]*)\)\s*;", body):
        ret, name, args = m.groups()
        rbase, rdepth, _, _ = _declarator(ret + " r")
        argtypes = []
        if args.strip() != "void":
            for a in args.split(","):
                base, depth, _, _ = _declarator(a)
                argtypes.append(_ctype(base, depth, structs, field=False))
        functions[name] = (argtypes, _ctype(rbase, rdepth, structs, field=False))
    return int(abi.group(1)), structs, functions


ABI_VERSION, STRUCTS, FUNCTIONS = parse()
HCWeight, HCInRule, HCLayer = STRUCTS["hc_weight"], STRUCTS["hc_in_rule"], STRUCTS["hc_layer"]


def bind(lib: ctypes.CDLL, header_text: str | None = None) -> None:
    """Every function of the header (this one, or another checkout's `header_text`) on `lib`, typed;
    AttributeError if the library lacks one."""
    for name, (argtypes, restype) in (FUNCTIONS if header_text is None else parse(header_text)[2]).items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = restype


def check_layouts(lib: ctypes.CDLL) -> None:
    """OSError if a struct's ctypes size differs from the compiler's (a type this module maps wrongly)."""
    for name, code in STRUCT_SIZE_CODES.items():
        c_size, py_size = lib.hc_struct_size(code), ctypes.sizeof(STRUCTS[name])
        if c_size != py_size:
            raise OSError(f"{name}: {c_size} bytes in C, {py_size} in ctypes (kernels/cabi.py)")
