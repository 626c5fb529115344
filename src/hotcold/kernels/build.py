"""Building, loading and calling the C CPU kernels (`_cpu_kernels.c`); the ops themselves are in `cpu.py`.

The source is compiled on first use with the system C compiler into a per-user cache, keyed by the
source, the compiler, its flags and the machine (what -march=native depends on), and bound through
ctypes (which releases the GIL, so a GPU thread can run at the same time). `get_lib()` returns the
loaded library, or None when the torch fallback must run: HOTCOLD_NO_CEXT=1, no working compiler, no
writable cache folder, or a library whose ABI version is not `ABI_VERSION`.

HOTCOLD_CFLAGS replaces the compiler flags (default: -O3 -march=native -fopenmp, then safer sets);
HOTCOLD_CACHE_DIR the cache folder (default: $XDG_CACHE_HOME/hotcold or ~/.cache/hotcold); CC the
compiler (default: cc, then gcc).

The functions and structs are bound from the header `c/hotcold.h` (kernels/cabi.py). The end of this file is
the calling convention that `cpu.py` uses for the C functions (and its torch
fallbacks for their checks): a weight as (type code, data pointer, row stride in bytes) or an `HCWeight`,
tokens as a contiguous float32 [T, n], row masks as a contiguous bool [T, F] (bytes 0 / 1).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch
from gguf import GGMLQuantizationType

from hotcold.gguf.quants import QuantTensor, row_bytes
from hotcold.kernels import cabi
from hotcold.kernels.cabi import ABI_VERSION, HCInRule, HCLayer, HCWeight

__all__ = ["ABI_VERSION", "WT", "HCInRule", "HCLayer", "HCWeight", "get_lib", "backend", "simd"]

log = logging.getLogger(__name__)

Q = GGMLQuantizationType

_SRC = Path(__file__).with_name("_cpu_kernels.c")  # one translation unit: it #includes the pieces in c/
_PIECES = Path(__file__).with_name("c")


def source_bytes() -> bytes:
    """The kernels' whole source (the unity file and every piece it includes), for the build cache's key."""
    pieces = sorted([*_PIECES.glob("*.c"), *_PIECES.glob("*.h")])
    return b"\0".join([_SRC.read_bytes(), *(p.name.encode() + b"\0" + p.read_bytes() for p in pieces)])


# Weight type codes of the C dispatch (HC_DISPATCH in _cpu_kernels.c).
WT = {Q.F32: 0, Q.F16: 1, Q.BF16: 2, Q.Q8_0: 3, Q.Q4_0: 4, Q.Q5_0: 5, Q.Q6_K: 6}
WT.update({Q.Q4_1: 7, Q.Q5_1: 8, Q.Q2_K: 9, Q.Q3_K: 10, Q.Q4_K: 11, Q.Q5_K: 12, Q.IQ4_NL: 13, Q.IQ4_XS: 14})
WT[Q.MXFP4] = 15
_TORCH_QTYPE = {torch.float32: Q.F32, torch.float16: Q.F16, torch.bfloat16: Q.BF16}
# -ffp-contract=off: a * b + c is two roundings unless the source asks for fmaf/vfma, so dequantized
# values are ggml's (d * q - m, unfused) whatever the compiler's default contraction is.
_BASE_FLAGS = ["-shared", "-fPIC", "-std=gnu11", "-Wno-psabi", "-ffp-contract=off"]
_FLAG_SETS = (["-O3", "-march=native", "-fopenmp"], ["-O3", "-fopenmp"], ["-O3"])

COMPILING = "hotcold: compiling the C CPU kernels with {cc}, once (about 30 s; cached in {cache}); "
COMPILING += "they need a C compiler: without one (or if this fails) hotcold runs on slower torch kernels"
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_loaded = False


def _cache_dir() -> Path:
    if d := os.environ.get("HOTCOLD_CACHE_DIR"):
        return Path(d)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hotcold"


def _machine_signature() -> bytes:
    """What -march=native depends on: the CPU's model and feature flags."""
    sig = [platform.machine(), platform.processor()]
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features", "model name", "CPU part")):
                    sig.append(line.strip())
                if line.strip() == "":
                    break  # the first processor is enough
    except OSError:
        pass
    return "\n".join(sig).encode()


def _writable_cache_dir() -> Path | None:
    """The cache folder, or a private one under the temp folder when that is not writable."""
    fallback = Path(tempfile.gettempdir()) / f"hotcold-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
    for d in (_cache_dir(), fallback):
        try:
            d.mkdir(parents=True, exist_ok=True, mode=0o700)
            if os.access(d, os.W_OK):
                return d
        except OSError:
            continue
    return None


def _compile(cc: str, flags: list[str], out: Path, *, announce: bool = False) -> bool:
    if announce:  # a person waits ~30 s, once: say why (logging's default level would hide it)
        print(COMPILING.format(cc=cc, cache=out.parent), file=sys.stderr)
    try:
        fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent)
        os.close(fd)
    except OSError as e:
        log.debug("cannot write to %s: %s", out.parent, e)
        return False
    try:
        cmd = [cc, *flags, *_BASE_FLAGS, "-o", tmp, str(_SRC)]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if res.returncode != 0:
            log.debug("compiling the CPU kernels failed: %s\n%s", " ".join(cmd), res.stderr[-4000:])
            return False
        os.replace(tmp, out)  # atomic: a concurrent build of the same key writes the same bytes
        return True
    except (OSError, subprocess.SubprocessError) as e:
        log.debug("compiling the CPU kernels failed: %s", e)
        return False
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _build_and_load() -> ctypes.CDLL | None:
    if os.environ.get("HOTCOLD_NO_CEXT", "") not in ("", "0"):
        log.info("HOTCOLD_NO_CEXT is set: using the torch CPU kernels")
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler (cc/gcc) found: using the slower torch CPU kernels (install gcc or clang)")
        return None
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("C compiler %s does not run (%s): using the slower torch CPU kernels", cc, e)
        return None
    cache = _writable_cache_dir()
    if cache is None:
        log.warning("no writable cache folder for the compiled CPU kernels: using torch")
        return None
    src = source_bytes()
    custom = os.environ.get("HOTCOLD_CFLAGS")  # e.g. "-O3 -mavx2 -mfma -mf16c -fopenmp"
    for i, flags in enumerate([custom.split()] if custom else _FLAG_SETS):
        h = hashlib.sha256()
        for part in (src, cc.encode(), version, " ".join(flags + _BASE_FLAGS).encode(), _machine_signature()):
            h.update(part)
            h.update(b"\0")
        path = cache / f"cpu_kernels-{h.hexdigest()[:20]}.so"
        if not path.exists() and not _compile(cc, flags, path, announce=i == 0):
            continue
        try:
            lib = ctypes.CDLL(str(path))
            if lib.hc_abi_version() != ABI_VERSION:
                raise OSError(f"ABI version {lib.hc_abi_version()}, expected {ABI_VERSION}")
            cabi.bind(lib)
            cabi.check_layouts(lib)
        except (OSError, AttributeError) as e:
            log.debug("loading %s failed: %s", path, e)
            continue
        log.debug("CPU kernels: %s (%s, %s)", path, lib.hc_simd().decode(), " ".join(flags))
        return lib
    log.warning("compiling the C CPU kernels failed (run with debug logging for details): using torch")
    return None


def get_lib() -> ctypes.CDLL | None:
    """The loaded C library (built on the first call, once per process), or None: use torch."""
    global _lib, _loaded
    if not _loaded:
        with _lock:
            if not _loaded:
                _lib = _build_and_load()
                _loaded = True
    return _lib


def backend() -> str:
    """Which kernels run: "c" (compiled) or "torch" (the fallback)."""
    return "c" if get_lib() is not None else "torch"


def simd() -> str:
    """The instruction set the C kernels were built for ("avx512", "avx2", "generic"), or "none"."""
    lib = get_lib()
    return lib.hc_simd().decode() if lib is not None else "none"


def _reset_for_tests(*, force_torch: bool | None = None) -> None:
    """Forget the loaded library (tests switch backends with HOTCOLD_NO_CEXT)."""
    global _lib, _loaded
    with _lock:
        _lib, _loaded = None, False
    if force_torch is not None:
        if force_torch:
            os.environ["HOTCOLD_NO_CEXT"] = "1"
        else:
            os.environ.pop("HOTCOLD_NO_CEXT", None)


# The calling convention of the C functions (cpu.py's torch fallbacks check their inputs the same way)


def weight_view(weight: torch.Tensor | QuantTensor) -> tuple[Q, torch.Tensor, int, int, int]:
    """A CPU weight [F, D] as the C kernels read it -> (qtype, tensor holding the bytes, row stride in
    bytes, F, D); ValueError / TypeError for anything they cannot read."""
    if isinstance(weight, QuantTensor):
        data = weight.data
        f, d = weight.shape
        qtype = weight.qtype
        stride = data.stride(0) if f > 1 else row_bytes(qtype, d)
    elif isinstance(weight, torch.Tensor):
        qtype = _TORCH_QTYPE.get(weight.dtype)
        if qtype is None or weight.dim() != 2:
            raise ValueError(
                f"weight must be a 2-D float32/float16/bfloat16 tensor or a QuantTensor, "
                f"got {weight.dtype} of shape {tuple(weight.shape)}"
            )
        data = weight
        f, d = weight.shape
        rs, cs = weight.stride()
        if cs != 1 and f > 0 and d > 1:
            raise ValueError("weight rows must be contiguous (weight.stride(1) == 1)")
        stride = (rs if f > 1 else d) * weight.element_size()
    else:
        raise TypeError(f"weight must be a torch.Tensor or a QuantTensor, got {type(weight).__name__}")
    if not data.is_cpu:
        raise ValueError(f"CPU kernels need CPU weights, got a tensor on {data.device}")
    if qtype not in WT:
        raise ValueError(f"no CPU kernel for weight type {qtype.name}")
    return qtype, data, stride, f, d


def hc_weight(weight: torch.Tensor | QuantTensor | None) -> HCWeight | None:
    """The hc_weight struct of a weight (None stays None); it points into the weight, keep that alive."""
    if weight is None:
        return None
    qtype, data, stride, f, d = weight_view(weight)
    packed = getattr(weight, "packed", None)
    return HCWeight(WT[qtype], data.data_ptr(), stride, f, d, None if packed is None else packed.data_ptr())


def as_tokens(x: torch.Tensor, n: int, what: str) -> tuple[torch.Tensor, bool]:
    """x [T, n] or [n] -> contiguous float32 [T, n], and whether the input was 1-D."""
    if not x.is_cpu:
        raise ValueError(f"{what} must be on the CPU, got {x.device}")
    one = x.dim() == 1
    x2 = x.unsqueeze(0) if one else x
    if x2.dim() != 2 or x2.shape[1] != n:
        raise ValueError(f"{what} has shape {tuple(x.shape)}, expected [T, {n}]")
    if x2.dtype != torch.float32 or not x2.is_contiguous():
        x2 = x2.to(torch.float32).contiguous()
    return x2, one


def as_mask(rows: torch.Tensor | None, t: int, f: int) -> torch.Tensor | None:
    """rows: None, bool [T, F] or bool [F] (same rows for every token) -> None or contiguous bool
    [T, F] (its bytes are 0 / 1, read as uint8 by the C code)."""
    if rows is None:
        return None
    if rows.dtype != torch.bool:
        raise ValueError(f"rows must be a bool mask, got {rows.dtype}")
    if rows.dim() == 1:
        rows = rows.unsqueeze(0).expand(t, -1)
    if rows.dim() != 2 or rows.shape[0] != t or rows.shape[1] != f:
        raise ValueError(f"rows mask has shape {tuple(rows.shape)}, expected [{t}, {f}]")
    if not rows.is_cpu:
        rows = rows.cpu()
    return rows if rows.is_contiguous() else rows.contiguous()


def nthreads(threads: int | None) -> int:
    return max(1, int(threads if threads is not None else torch.get_num_threads()))


def ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def f32_contiguous(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.is_cpu and t.is_contiguous()
