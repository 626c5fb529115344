"""CPU sparse FFN kernels over any weight type: row-gather GEMV and sparse axpy.

The work is done by `_cpu_kernels.c` (OpenMP + AVX-512/AVX2/F16C, portable fallback), compiled on
first use with the system C compiler into a per-user cache and called through ctypes (which
releases the GIL, so a GPU thread can run at the same time). Without a compiler, or with
HOTCOLD_NO_CEXT=1, a pure-torch fallback computes the same results (up to fp32 rounding).
HOTCOLD_CFLAGS replaces the compiler flags (default: -O3 -march=native -fopenmp, then safer sets);
HOTCOLD_CACHE_DIR the cache folder (default: $XDG_CACHE_HOME/hotcold or ~/.cache/hotcold).

Weights are [F, D]: row i is neuron i (ffn_up / ffn_gate, and ffn_down_t for the axpy). They are
float32/float16/bfloat16 torch tensors or `QuantTensor`s (Q8_0, Q4_0, Q5_0, Q6_K, ...), read in
their stored format: each needed row is read once per call, for all tokens that need it, and block
formats are dequantized on the fly. Results are bit-identical for any thread count.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch
from gguf import GGMLQuantizationType

from hotcold.quants import QuantTensor, row_bytes

__all__ = [
    "Weight",
    "gather_matvec",
    "sparse_axpy",
    "matmul",
    "backend",
    "simd",
    "dequantize_rows",
    "dequantize_bytes",
    "SparseFFNPlan",
    "MatvecGroup",
    "rms_norm",
    "attention_decode",
]

log = logging.getLogger(__name__)

Weight = torch.Tensor | QuantTensor
Q = GGMLQuantizationType

_SRC = Path(__file__).with_name("_cpu_kernels.c")
_ABI_VERSION = 9
_WT = {Q.F32: 0, Q.F16: 1, Q.BF16: 2, Q.Q8_0: 3, Q.Q4_0: 4, Q.Q5_0: 5, Q.Q6_K: 6}
_TORCH_QTYPE = {torch.float32: Q.F32, torch.float16: Q.F16, torch.bfloat16: Q.BF16}
_BASE_FLAGS = ["-shared", "-fPIC", "-std=gnu11", "-Wno-psabi"]
_FLAG_SETS = (["-O3", "-march=native", "-fopenmp"], ["-O3", "-fopenmp"], ["-O3"])
# T at or above which matmul dequantizes blocks of rows and hands them to torch's GEMM.
GEMM_MIN_TOKENS = 48

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_loaded = False


# ------------------------------------------------------------------------------------------------
# Building and loading the C library
# ------------------------------------------------------------------------------------------------


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


def _compile(cc: str, flags: list[str], out: Path) -> bool:
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


def _bind(lib: ctypes.CDLL) -> None:
    i64, p, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    kern = [c_int, p, i64, i64, i64, p, i64, p, p, c_int]
    lib.hc_gather_matvec.argtypes = kern
    lib.hc_gather_matvec.restype = c_int
    lib.hc_sparse_axpy.argtypes = kern
    lib.hc_sparse_axpy.restype = c_int
    lib.hc_dequantize.argtypes = [c_int, p, i64, p, i64, i64, p, c_int]
    lib.hc_dequantize.restype = c_int
    lib.hc_simd.restype = ctypes.c_char_p
    w = ctypes.POINTER(_HCWeight)
    lib.hc_sparse_ffn.argtypes = [
        w,
        w,
        ctypes.c_float,
        p,
        w,
        w,
        w,
        p,
        c_int,
        i64,
        p,
        p,
        ctypes.c_float,
        p,
        p,
        c_int,
    ]
    lib.hc_sparse_ffn.restype = i64
    lib.hc_matvec_multi.argtypes = [c_int, p, p, p, p, i64, p, i64, p, ctypes.c_float, p, c_int]
    lib.hc_matvec_multi.restype = c_int
    f32 = ctypes.c_float
    lib.hc_rms_norm.argtypes = [p, p, f32, i64, i64, p]
    lib.hc_rms_norm.restype = None
    lib.hc_attn_decode.argtypes = [p, p, p, p, p, i64, i64, i64, i64, i64, p, p, c_int, i64, p, c_int]
    lib.hc_attn_decode.restype = c_int


class _HCWeight(ctypes.Structure):
    """hc_weight in _cpu_kernels.c."""

    _fields_ = [
        ("wt", ctypes.c_int),
        ("data", ctypes.c_void_p),
        ("stride", ctypes.c_int64),
        ("rows", ctypes.c_int64),
        ("cols", ctypes.c_int64),
    ]


def _build_and_load() -> ctypes.CDLL | None:
    if os.environ.get("HOTCOLD_NO_CEXT", "") not in ("", "0"):
        log.info("HOTCOLD_NO_CEXT is set: using the torch CPU kernels")
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler (cc/gcc) found: using the slower torch CPU kernels")
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
    src = _SRC.read_bytes()
    custom = os.environ.get("HOTCOLD_CFLAGS")  # e.g. "-O3 -mavx2 -mfma -mf16c -fopenmp"
    for flags in [custom.split()] if custom else _FLAG_SETS:
        h = hashlib.sha256()
        for part in (src, cc.encode(), version, " ".join(flags + _BASE_FLAGS).encode(), _machine_signature()):
            h.update(part)
            h.update(b"\0")
        path = cache / f"cpu_kernels-{h.hexdigest()[:20]}.so"
        if not path.exists() and not _compile(cc, flags, path):
            continue
        try:
            lib = ctypes.CDLL(str(path))
            if lib.hc_abi_version() != _ABI_VERSION:
                raise OSError(f"ABI version {lib.hc_abi_version()}, expected {_ABI_VERSION}")
            _bind(lib)
        except (OSError, AttributeError) as e:
            log.debug("loading %s failed: %s", path, e)
            continue
        log.debug("CPU kernels: %s (%s, %s)", path, lib.hc_simd().decode(), " ".join(flags))
        return lib
    log.warning("compiling the C CPU kernels failed (run with debug logging for details): using torch")
    return None


def _get_lib() -> ctypes.CDLL | None:
    global _lib, _loaded
    if not _loaded:
        with _lock:
            if not _loaded:
                _lib = _build_and_load()
                _loaded = True
    return _lib


def backend() -> str:
    """Which kernels run: "c" (compiled) or "torch" (the fallback)."""
    return "c" if _get_lib() is not None else "torch"


def simd() -> str:
    """The instruction set the C kernels were built for ("avx512", "avx2", "generic"), or "none"."""
    lib = _get_lib()
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


# ------------------------------------------------------------------------------------------------
# Argument checking
# ------------------------------------------------------------------------------------------------


def _weight_view(weight: Weight) -> tuple[Q, torch.Tensor, int, int, int]:
    """-> (qtype, tensor holding the bytes, row stride in bytes, F, D)."""
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
    return qtype, data, stride, f, d


def _tokens(x: torch.Tensor, n: int, what: str) -> tuple[torch.Tensor, bool]:
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


def _mask(rows: torch.Tensor | None, t: int, f: int) -> torch.Tensor | None:
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


def _threads(threads: int | None) -> int:
    return max(1, int(threads if threads is not None else torch.get_num_threads()))


def _dense_rows(weight: Weight, idx: torch.Tensor | None) -> torch.Tensor:
    """float32 rows of a weight (all rows when idx is None): the torch fallback's copy."""
    if isinstance(weight, QuantTensor):
        return weight.dequantize(idx)
    w = weight if idx is None else weight.index_select(0, idx)
    return w.to(torch.float32)


# ------------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------------


def _run_row_kernel(fn, qtype: Q, data, stride: int, f: int, d: int, inp, mask, out, threads) -> None:
    """hc_gather_matvec / hc_sparse_axpy on checked arguments (inp: x [T, D] or a [T, F] float32)."""
    rc = fn(
        _WT[qtype],
        data.data_ptr(),
        stride,
        f,
        d,
        inp.data_ptr(),
        inp.shape[0],
        None if mask is None else mask.data_ptr(),
        out.data_ptr(),
        _threads(threads),
    )
    if rc != 0:
        raise MemoryError(f"{fn.__name__}: out of memory")


def gather_matvec(
    weight: Weight, x: torch.Tensor, rows: torch.Tensor | None, *, threads: int | None = None
) -> torch.Tensor:
    """out[t, i] = dot(W[i], x[t]) where rows is None or rows[t, i], exactly 0 elsewhere.

    weight [F, D]; x [T, D] (or [D]) float32; rows None, bool [T, F] or bool [F] -> float32 [T, F]
    (or [F]).
    """
    qtype, data, stride, f, d = _weight_view(weight)
    x2, one = _tokens(x, d, "x")
    t = x2.shape[0]
    mask = _mask(rows, t, f)
    lib = _get_lib()
    if lib is not None:
        out = torch.empty(t, f, dtype=torch.float32)
        _run_row_kernel(lib.hc_gather_matvec, qtype, data, stride, f, d, x2, mask, out, threads)
    else:
        out = _torch_gather(weight, x2, mask)
    return out[0] if one else out


def _torch_gather(weight: Weight, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is None:
        return x @ _dense_rows(weight, None).T
    idx = mask.any(0).nonzero().squeeze(1)
    out = torch.zeros(x.shape[0], mask.shape[1], dtype=torch.float32)
    if idx.numel():
        part = x @ _dense_rows(weight, idx).T  # [T, n]
        out[:, idx] = torch.where(mask[:, idx], part, torch.zeros(()))
    return out


def sparse_axpy(
    weight_t: Weight, a: torch.Tensor, rows: torch.Tensor | None, *, threads: int | None = None
) -> torch.Tensor:
    """out[t] = sum over i with (rows is None or rows[t, i]) and a[t, i] != 0 of a[t, i] * W_t[i].

    weight_t [F, D] (row i = neuron i's output direction, ffn_down_t); a [T, F] (or [F]) float32;
    rows None, bool [T, F] or bool [F] -> float32 [T, D] (or [D]). A token's rows are summed in ascending
    order in blocks of 64, then the block sums in order (see _cpu_kernels.c): the same bits for any thread
    count and batch.
    """
    qtype, data, stride, f, d = _weight_view(weight_t)
    a2, one = _tokens(a, f, "a")
    t = a2.shape[0]
    mask = _mask(rows, t, f)
    lib = _get_lib()
    if lib is not None:
        out = torch.empty(t, d, dtype=torch.float32)
        _run_row_kernel(lib.hc_sparse_axpy, qtype, data, stride, f, d, a2, mask, out, threads)
    else:
        out = _torch_axpy(weight_t, a2, mask)
    return out[0] if one else out


def _torch_axpy(weight_t: Weight, a: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    active = a != 0
    if mask is not None:
        active &= mask
    idx = active.any(0).nonzero().squeeze(1)
    out = torch.zeros(a.shape[0], weight_t.shape[1], dtype=torch.float32)
    if idx.numel():
        coef = torch.where(active[:, idx], a[:, idx], torch.zeros(()))  # [T, n]
        out += coef @ _dense_rows(weight_t, idx)
    return out


def matmul(weight: Weight, x: torch.Tensor, *, threads: int | None = None) -> torch.Tensor:
    """Dense x @ W.T for any weight type: x [T, D] (or [D]) -> float32 [T, F] (or [F]).

    Small T streams the weight through the C kernel; large T (prefill) dequantizes blocks of rows
    into a small float32 buffer and uses torch's GEMM, which is compute- not bandwidth-bound there.
    """
    qtype, data, stride, f, d = _weight_view(weight)
    x2, one = _tokens(x, d, "x")
    t = x2.shape[0]
    lib = _get_lib()
    if lib is not None and t < GEMM_MIN_TOKENS:  # gather_matvec over every row, without its checks again
        out = torch.empty(t, f, dtype=torch.float32)
        _run_row_kernel(lib.hc_gather_matvec, qtype, data, stride, f, d, x2, None, out, threads)
    elif lib is None:
        out = gather_matvec(weight, x2, None, threads=threads)
    elif isinstance(weight, torch.Tensor) and qtype == Q.F32:
        out = x2 @ weight.T
    else:
        out = torch.empty(t, f, dtype=torch.float32)
        block = max(1, (1 << 22) // max(1, d))  # 16 MiB float32 buffer
        buf = torch.empty(min(block, f), d, dtype=torch.float32)
        for r0 in range(0, f, block):
            r1 = min(f, r0 + block)
            w = dequantize_rows(weight, r0, r1, out=buf[: r1 - r0], threads=threads)
            torch.matmul(x2, w.T, out=out[:, r0:r1])
    return out[0] if one else out


_FFN_KINDS = {"gated": 0, "gated_both": 1, "plain": 2}


def _hc_weight(weight: Weight | None) -> _HCWeight | None:
    if weight is None:
        return None
    qtype, data, stride, f, d = _weight_view(weight)
    if qtype not in _WT:
        raise ValueError(f"no CPU kernel for weight type {qtype.name}")
    return _HCWeight(_WT[qtype], data.data_ptr(), stride, f, d)


def _norm_weight(norm: tuple[torch.Tensor, float] | None, d: int) -> tuple[torch.Tensor | None, float]:
    """(weight, eps) of an RMS norm applied inside a C call -> (float32 contiguous weight or None, eps)."""
    if norm is None:
        return None, 0.0
    weight, eps = norm
    weight = weight.to(torch.float32).contiguous()
    if weight.shape != (d,) or not weight.is_cpu:
        raise ValueError(
            f"norm weight has shape {tuple(weight.shape)} on {weight.device}, expected [{d}] on the CPU"
        )
    return weight, float(eps)


class SparseFFNPlan:
    """One ReLU sparse FFN step in a single C call: the predictor (fc1/fc2 on pred_input, firing iff the
    logit >= threshold) or a given bool mask, the row gathers (gate first; up only where relu(gate) != 0),
    the activation (with v = up + up_bias: relu(gate) * v, relu(gate) * relu(v), or relu(v) for "plain")
    and the axpy over down_t.

    Equal bit for bit to gather_matvec / matmul / sparse_axpy called one by one (it runs the same C
    code), without the interpreter and tensor glue in between. Shapes are checked and the C argument
    structs built once; the plan keeps its weights alive.
    """

    def __init__(
        self,
        up: Weight,
        gate: Weight | None,
        down_t: Weight,
        *,
        kind: str = "gated",
        up_bias: torch.Tensor | None = None,
        fc1: Weight | None = None,
        fc2: Weight | None = None,
        threshold: float = 0.0,
    ):
        if (fc1 is None) != (fc2 is None):
            raise ValueError("a predictor needs both fc1 and fc2")
        if kind not in _FFN_KINDS:
            raise ValueError(f"unknown FFN kind {kind!r}; expected one of {tuple(_FFN_KINDS)}")
        self.weights = (up, gate, down_t, fc1, fc2)  # kept alive: the structs point into them
        self.up, self.gate, self.down_t = _hc_weight(up), _hc_weight(gate), _hc_weight(down_t)
        self.fc1, self.fc2 = _hc_weight(fc1), _hc_weight(fc2)
        self.f, self.d = self.up.rows, self.up.cols
        f, d = self.f, self.d
        checks = [("gate", self.gate, (f, d)), ("down_t", self.down_t, (f, d))]
        if self.fc1 is not None:
            checks += [("fc1", self.fc1, (self.fc1.rows, d)), ("fc2", self.fc2, (f, self.fc1.rows))]
        for name, w, shape in checks:
            if w is not None and (w.rows, w.cols) != shape:
                raise ValueError(f"{name} has shape {(w.rows, w.cols)}, expected {shape}")
        self.bias = None
        if up_bias is not None:
            self.bias = up_bias.to(torch.float32).contiguous()
            if self.bias.shape != (f,):
                raise ValueError(f"up_bias has shape {tuple(self.bias.shape)}, expected [{f}]")
        self.kind = _FFN_KINDS[kind]
        self.threshold = threshold
        ref = ctypes.byref
        self._args = tuple(
            None if w is None else ref(w) for w in (self.fc1, self.fc2, self.up, self.gate, self.down_t)
        )

    def __call__(
        self,
        x: torch.Tensor,
        pred_input: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
        *,
        norm: tuple[torch.Tensor, float] | None = None,
        threads: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """x, pred_input [T, D] float32 (or a mask `rows` [T, F] when the plan has no predictor) ->
        (out [T, D], mask [T, F] bool, firing count), or None without the C kernels. With norm = (weight,
        eps) the FFN input is rms_norm(x) (as `rms_norm` computes it for a few tokens), pred_input as given."""
        lib = _get_lib()
        if lib is None:
            return None
        x2, _ = _tokens(x, self.d, "x")
        t = x2.shape[0]
        if (self.fc1 is None) == (rows is None):
            raise ValueError("give a rows mask exactly when the plan has no predictor")
        if rows is not None:
            mask, p_ptr = _mask(rows, t, self.f).clone(), None
        else:
            mask = torch.empty(t, self.f, dtype=torch.bool)
            p2, _ = _tokens(pred_input, self.d, "pred_input")
            if p2.shape[0] != t:
                raise ValueError(f"pred_input has {p2.shape[0]} tokens, x has {t}")
            p_ptr = p2.data_ptr()
        norm_w, eps = _norm_weight(norm, self.d)
        out = torch.empty(t, self.d, dtype=torch.float32)
        fc1, fc2, up, gate, down_t = self._args
        fired = lib.hc_sparse_ffn(
            fc1,
            fc2,
            self.threshold,
            p_ptr,
            up,
            gate,
            down_t,
            None if self.bias is None else self.bias.data_ptr(),
            self.kind,
            t,
            x2.data_ptr(),
            None if norm_w is None else norm_w.data_ptr(),
            eps,
            mask.data_ptr(),
            out.data_ptr(),
            _threads(threads),
        )
        if fired < 0:
            raise MemoryError("hc_sparse_ffn: out of memory")
        return out, mask, int(fired)


class MatvecGroup:
    """[matmul(w, x) for w in weights] for few tokens, as one C call (a layer's q, k and v: the rows of
    all of them share one pass of the threads), with the same bits as separate calls. Weights must be
    CPU weights of the C kernels' types with the same number of columns; the group keeps them alive."""

    def __init__(self, weights: list[Weight]):
        views = [_weight_view(w) for w in weights]
        if not 1 <= len(views) <= 8 or len({v[4] for v in views}) != 1:
            raise ValueError("a matvec group is 1-8 matrices with the same number of columns")
        if bad := [v[0].name for v in views if v[0] not in _WT]:
            raise ValueError(f"no CPU kernel for weight type(s) {', '.join(bad)}")
        n = len(views)
        self.weights = list(weights)
        self.d = views[0][4]
        self.rows = [v[3] for v in views]
        self._wts = (ctypes.c_int * n)(*[_WT[v[0]] for v in views])
        self._ptrs = (ctypes.c_void_p * n)(*[v[1].data_ptr() for v in views])
        self._strides = (ctypes.c_int64 * n)(*[v[2] for v in views])
        self._fs = (ctypes.c_int64 * n)(*self.rows)
        self._out_ptrs = ctypes.c_void_p * n

    def __call__(
        self, x: torch.Tensor, *, norm: tuple[torch.Tensor, float] | None = None, threads: int | None = None
    ) -> list[torch.Tensor]:
        """With norm = (weight, eps), the matrices multiply rms_norm(x), computed in the same C call (few
        tokens and the C kernels only: otherwise normalise x first)."""
        lib = _get_lib()
        x2, one = _tokens(x, self.d, "x")
        t = x2.shape[0]
        norm_w, eps = _norm_weight(norm, self.d)
        if lib is None or t >= GEMM_MIN_TOKENS:
            if norm_w is not None:
                raise ValueError(f"a norm inside the call needs the C kernels and < {GEMM_MIN_TOKENS} tokens")
            return [matmul(w, x, threads=threads) for w in self.weights]
        outs = [torch.empty(t, f, dtype=torch.float32) for f in self.rows]
        out_ptrs = self._out_ptrs(*[o.data_ptr() for o in outs])  # per call: two threads may share a model
        rc = lib.hc_matvec_multi(
            len(outs),
            self._wts,
            self._ptrs,
            self._strides,
            self._fs,
            self.d,
            x2.data_ptr(),
            t,
            None if norm_w is None else norm_w.data_ptr(),
            eps,
            out_ptrs,
            _threads(threads),
        )
        if rc != 0:
            raise MemoryError("hc_matvec_multi failed")
        return [o[0] for o in outs] if one else outs


def _f32_contiguous(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.is_cpu and t.is_contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """x [T, D] / sqrt(mean(x^2) + eps) * weight in one C call (float64 sum of squares), or None when the
    C kernels or float32 contiguous CPU inputs are not there (the caller then uses torch)."""
    lib = _get_lib()
    if lib is None or x.dim() != 2 or not (_f32_contiguous(x) and _f32_contiguous(weight)):
        return None
    t, d = x.shape
    if weight.shape != (d,):
        return None
    out = torch.empty_like(x)
    lib.hc_rms_norm(x.data_ptr(), weight.data_ptr(), eps, t, d, out.data_ptr())
    return out


def attention_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    neox: bool,
    sliding_window: int | None = None,
    threads: int | None = None,
) -> torch.Tensor | None:
    """One token's attention in one C call: RoPE on q [1, H, Dh] and k [1, Hkv, Dh] (cos/sin [1, R/2]), k and
    v stored at row pos of the float32 caches [S, Hkv, Dh], causal softmax attention over rows 0..pos (the
    last `sliding_window` of them when given) -> [1, H*Dh]. None when it does not apply (no C kernels, not
    float32 on the CPU, more than one token): the caller then uses torch. q and k are rotated in place."""
    lib = _get_lib()
    if lib is None or q.shape[0] != 1 or not all(_f32_contiguous(t) for t in (q, k, v, k_cache, v_cache)):
        return None
    _, h, dh = q.shape
    hkv = k.shape[1]
    cos, sin = cos.contiguous(), sin.contiguous()
    if (
        not (_f32_contiguous(cos) and _f32_contiguous(sin))
        or h % hkv
        or k_cache.shape[1:] != (hkv, dh)
        or cos.shape[-1] * 2 > dh
        or not 0 <= pos < k_cache.shape[0]
    ):
        return None
    out = torch.empty(1, h * dh, dtype=torch.float32)
    rc = lib.hc_attn_decode(
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        pos,
        h,
        hkv,
        dh,
        cos.shape[-1] * 2,
        cos.data_ptr(),
        sin.data_ptr(),
        int(neox),
        sliding_window or 0,
        out.data_ptr(),
        _threads(threads),
    )
    if rc != 0:
        raise MemoryError("hc_attn_decode: out of memory")
    return out


def dequantize_rows(
    weight: Weight,
    start: int = 0,
    stop: int | None = None,
    *,
    out: torch.Tensor | None = None,
    threads: int | None = None,
) -> torch.Tensor:
    """float32 copy of rows [start, stop) of any weight, exact as ggml's dequantization."""
    qtype, data, stride, f, d = _weight_view(weight)
    stop = f if stop is None else stop
    n = max(0, stop - start)
    if out is None:
        out = torch.empty(n, d, dtype=torch.float32)
    lib = _get_lib()
    if lib is None:
        out.copy_(_dense_rows(weight, torch.arange(start, stop)))
        return out
    base = data.data_ptr() + start * stride if n else data.data_ptr()
    lib.hc_dequantize(_WT[qtype], base, stride, None, n, d, out.data_ptr(), _threads(threads))
    return out


def dequantize_bytes(raw: torch.Tensor, qtype: Q, rows: int, cols: int) -> torch.Tensor | None:
    """uint8 [rows * row_bytes] on the CPU -> float32 [rows, cols] with the C kernel, or None when
    the C kernels are not available (the caller then uses its own path)."""
    lib = _get_lib()
    if lib is None or qtype not in _WT:
        return None
    out = torch.empty(rows, cols, dtype=torch.float32)
    nb = row_bytes(qtype, cols)
    lib.hc_dequantize(
        _WT[qtype], raw.data_ptr(), nb, None, rows, cols, out.data_ptr(), torch.get_num_threads()
    )
    return out
