"""hotcold.kernels.cabi: the C header is the one list of what Python calls, read into ctypes types that match
the compiler's layouts, and every function the C pieces export is in it."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest

from hotcold.kernels import build, cabi

PIECES = Path(cabi.__file__).with_name("c")

SMALL = """
#define HC_ABI_VERSION 7
typedef struct { int wt; const uint8_t *data; int64_t stride, rows; } hc_weight; /* a comment */
typedef struct hc_layer {
    int wts[3];
    const float *a, *b;
    const hc_weight *wo, *up; /* typed pointers */
    const hc_weight *const *e_up, *const *e_gate;
    float thr;
} hc_layer;
int hc_one(const hc_weight *w, const float *x, int64_t n, float *const *outs, const hc_layer *const *Ls);
const char *hc_name(void);
void hc_none(float eps);
"""


def test_a_small_header_reads_into_the_ctypes_it_means():
    abi, structs, functions = cabi.parse(SMALL)
    assert abi == 7
    w, layer = structs["hc_weight"], structs["hc_layer"]
    assert [name for name, _ in layer._fields_] == ["wts", "a", "b", "wo", "up", "e_up", "e_gate", "thr"]
    types = dict(layer._fields_)
    assert types["wts"] == ctypes.c_int * 3
    assert types["a"] is ctypes.c_void_p and types["b"] is ctypes.c_void_p
    assert types["wo"] == ctypes.POINTER(w) and types["up"] == ctypes.POINTER(w)
    assert types["e_gate"] == ctypes.POINTER(ctypes.POINTER(w))
    assert dict(w._fields_)["rows"] is ctypes.c_int64
    args, ret = functions["hc_one"]
    assert args == [ctypes.POINTER(w), ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    assert ret is ctypes.c_int
    assert functions["hc_name"] == ([], ctypes.c_char_p)
    assert functions["hc_none"] == ([ctypes.c_float], None)


@pytest.mark.parametrize(
    "text, needle",
    [
        ("#define HC_ABI_VERSION 1\nint hc_f(size_t x);", "unknown type 'size_t'"),
        ("#define HC_ABI_VERSION 1\nint hc_f(struct s *x);", "cannot read"),
        ("int hc_f(int x);", "no HC_ABI_VERSION"),
    ],
)
def test_a_header_it_cannot_bind_is_refused_by_name(text, needle):
    with pytest.raises(cabi.HeaderError, match=re.escape(needle)):
        cabi.parse(text)


def test_every_exported_c_function_is_declared_in_the_header():
    """A function the pieces define without `static` is exported: it must be in hotcold.h (and so bound)."""
    defined = set()
    for piece in PIECES.glob("*.c"):
        for m in re.finditer(r"^(?!static)(?:const\s+)?\w+\s*\**\s*(hc_\w+)\(", piece.read_text(), re.M):
            defined.add(m.group(1))
    assert defined == set(cabi.FUNCTIONS)


def test_the_layouts_match_the_compiler_and_every_function_binds():
    lib = build.get_lib()
    if lib is None:
        pytest.skip("no C build")
    cabi.check_layouts(lib)  # raises on a mismatch
    assert lib.hc_abi_version() == cabi.ABI_VERSION
    for name, (argtypes, restype) in cabi.FUNCTIONS.items():
        fn = getattr(lib, name)
        assert (fn.argtypes, fn.restype) == (argtypes, restype), name
    assert ctypes.sizeof(cabi.HCLayer) == lib.hc_struct_size(2)
    assert lib.hc_struct_size(99) == -1
