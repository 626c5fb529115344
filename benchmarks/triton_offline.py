"""Compile the fused decode kernels (kernels/triton_decode.py) for an NVIDIA GPU without one: Triton's own
compiler to PTX, its bundled ptxas to SASS. Per kernel variant: whether it compiles, its global loads by
width (16-byte `v4` loads are what a memory-bound kernel needs; `cp.async NB` counts the loads Triton's
software pipeliner issues ahead into shared memory for a `tl.range(..., num_stages=)` loop) and, where ptxas
reports them, registers and spilled bytes. The interpreter tests check the arithmetic; this checks what only a compile shows.

    python benchmarks/triton_offline.py [--arch 90] [--json out.json]

Arguments get the hints Triton's launcher gives real 7B-shaped calls: every pointer 16-byte aligned and
sizes / strides divisible by 16.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import warnings

F16, U8, F32 = "*fp16", "*u8", "*fp32"


def variants(tile_rows: int = 16, tile_cols: int = 256) -> list[tuple]:
    """(name, kernel, signature, constexprs, args divisible by 16) as the 7B decode step launches them."""
    from hotcold.kernels import triton_decode as td
    from hotcold.kernels import triton_ffn as tf

    out = []
    gemv = {"w_ptr": F16, "x_ptr": F32, "nw_ptr": F32, "res_ptr": F32, "out_ptr": F32, "h_ptr": F32,
            "count_ptr": F32, "bc_ptr": F32, "thr": "fp32", "eps": "fp32", "R": "i32", "D": "i32", "stride_w": "i32"}  # fmt: skip
    names = ("NORM", "RELU", "RESIDUAL", "THRESHOLD", "WRITE_NORMED", "BLOCK_COUNTS")
    for label, on in (("o+residual", {"RESIDUAL"}), ("head (norm)", {"NORM"}), ("fc1", {"RELU", "WRITE_NORMED"}),
                      ("fc2 threshold", {"THRESHOLD", "BLOCK_COUNTS"})):  # fmt: skip
        sig = dict(gemv, **{n: "constexpr" for n in names}, BLOCK_R="constexpr", BLOCK_D="constexpr")
        if "THRESHOLD" in on:
            sig.update(out_ptr="*i8", count_ptr="*i32", bc_ptr="*i32")
        consts = {n: n in on for n in names} | {"BLOCK_R": tile_rows, "BLOCK_D": tile_cols}
        out.append((f"gemv {label}", td._gemv_kernel, sig, consts, ("R", "D", "stride_w")))
    qkv = {"w_ptr": F16, "x_ptr": F32, "nw_ptr": F32, "eps": "fp32", "pos_ptr": "*i64", "cos_ptr": F32,
           "sin_ptr": F32, "q_ptr": F32, "kc_ptr": F16, "vc_ptr": F16, "D": "i32", "stride_w": "i32", "QD": "i32",
           "KVD": "i32", "HALF": "constexpr", "BLOCK_P": "constexpr", "BLOCK_D": "constexpr"}  # fmt: skip
    out.append(("qkv_rope", td._qkv_rope_kernel, qkv, {"HALF": 64, "BLOCK_P": tile_rows, "BLOCK_D": tile_cols},
                ("D", "stride_w", "QD", "KVD")))  # fmt: skip
    att = {"q_ptr": F32, "kc_ptr": F16, "vc_ptr": F16, "pos_ptr": "*i64", "out_ptr": F32, "scale": "fp32",
           "window": "i32", "GROUP": "i32", "KVD": "i32", "DH": "constexpr", "BLOCK_N": "constexpr"}  # fmt: skip
    out.append(("attention", td._attention_kernel, att, {"DH": 128, "BLOCK_N": 64}, ("KVD",)))
    gu = {"gate_ptr": F16, "up_ptr": F16, "h_ptr": F32, "nw_ptr": F32, "eps": "fp32", "m_ptr": "*i8",
          "idx_ptr": "*i64", "bc_ptr": "*i32", "list_ptr": "*i32", "a_ptr": F32, "F": "i32", "D": "i32", "stride_g": "i32",
          "stride_u": "i32"}  # fmt: skip
    gu |= {
        n: "constexpr"
        for n in (
            "QG",
            "QU",
            "NORM",
            "HAS_MASK",
            "HAS_IDX",
            "COMPACT",
            "KIND",
            "ACT",
            "G",
            "STAGES",
            "BLOCK_R",
            "BLOCK_D",
        )  # fmt: skip
    }
    stages = td.GPU_TILE["stages"]
    for label, ptr, q, cols in (("f16", F16, 0, tile_cols), ("q8_0", U8, 1, tile_cols // 2),
                                ("q4_0", U8, 2, tile_cols // 2)):  # fmt: skip
        for norm, mask, idx, compact in ((False, True, False, False), (True, False, False, False),
                                         (False, True, True, False), (False, True, False, True),
                                         (False, True, True, True)):  # fmt: skip
            rows = td.GPU_TILE["compact_rows"] if compact else tile_rows
            consts = dict(QG=q, QU=q, NORM=norm, HAS_MASK=mask, HAS_IDX=idx, COMPACT=compact, KIND=0, ACT=0,
                          G=td.MASK_GROUP, STAGES=stages, BLOCK_R=rows, BLOCK_D=cols)  # fmt: skip
            kind = ("dense (norm)" if norm else "hybrid hot rows (compacted list)" if idx and compact
                    else "hybrid hot rows (mask, rows)" if idx else "sparse (compacted list)" if compact
                    else "sparse (mask)")  # fmt: skip
            sig = dict(gu, gate_ptr=ptr, up_ptr=ptr, idx_ptr="*i32" if compact else "*i64")
            out.append((f"gate_up {label} {kind}", tf._gate_up_kernel, sig, consts,
                        ("F", "D", "stride_g", "stride_u")))  # fmt: skip
    ax = {"w_ptr": F16, "a_ptr": F32, "rows_ptr": "*i32", "bc_ptr": "*i32", "part_ptr": F32, "F": "i32",
          "D": "i32", "rows_per_split": "i32", "stride_w": "i32", "QTYPE": "constexpr", "COMPACT": "constexpr",
          "G": "constexpr", "STAGES": "constexpr", "BLOCK_K": "constexpr", "BLOCK_D": "constexpr"}  # fmt: skip
    for label, ptr, q in (("f16", F16, 0), ("q8_0", U8, 1), ("q4_0", U8, 2)):
        for compact in (False, True):
            consts = {"QTYPE": q, "COMPACT": compact, "G": td.MASK_GROUP, "STAGES": stages, "BLOCK_K": 16,
                      "BLOCK_D": 256}  # fmt: skip
            name = f"down_axpy {label}" + (" (compacted list)" if compact else "")
            out.append((name, tf._down_axpy_kernel, dict(ax, w_ptr=ptr), consts,
                        ("F", "D", "rows_per_split", "stride_w")))  # fmt: skip
    # the hybrid general path's hot-row matvec (kernels/triton.py) for one token, as _config sets it on a GPU
    from hotcold.kernels import triton as kt

    mv = {"w_ptr": F16, "x_ptr": F32, "m_ptr": "*i1", "out_ptr": F32, "K": "i32", "D": "i32", "T": "i32",
          "stride_w": "i32", "stride_x": "i32", "stride_m": "i32", "stride_o": "i32"}  # fmt: skip
    mv |= {
        n: "constexpr" for n in ("QTYPE", "BLOCK_K", "BLOCK_D", "BLOCK_T", "USE_DOT", "PRECISION", "STAGES")
    }
    consts = dict(
        QTYPE=0, BLOCK_K=16, BLOCK_D=tile_cols, BLOCK_T=1, USE_DOT=False, PRECISION="tf32", STAGES=3
    )
    out.append(("hot_gather_matvec f16 (one token)", kt._matvec_kernel, mv, consts,
                ("K", "D", "stride_w", "stride_x", "stride_m", "stride_o")))  # fmt: skip
    red = {"part_ptr": F32, "res_ptr": F32, "out_ptr": F32, "D": "i32", "SPLITS": "constexpr",
           "BLOCK_D": "constexpr"}  # fmt: skip
    out.append(("reduce_residual", tf._reduce_residual_kernel, red, {"SPLITS": 33, "BLOCK_D": 256}, ("D",)))
    return out


def compile_one(kernel, signature: dict, constexprs: dict, divisible: tuple, arch: int) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    attrs = {
        (kernel.arg_names.index(k),): [["tt.divisibility", 16]]
        for k, t in signature.items()
        if (t.startswith("*") or k in divisible) and k not in constexprs
    }
    try:
        compiled = triton.compile(
            ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", arch, 32)
        )
    except Exception as exc:  # noqa: BLE001 (a compile error is the result)
        return {"compiles": False, "error": f"{type(exc).__name__}: {str(exc)[:800]}"}
    ptx = compiled.asm["ptx"]
    loads = collections.Counter(re.findall(r"ld\.global(?:\.nc)?(?:\.v(\d))?\.b(\d+)", ptx))
    row = {"compiles": True, "loads": {f"{int(v or 1) * int(b) // 8}B": n for (v, b), n in loads.items()}}
    # loads the software pipeline issues ahead (tl.range(num_stages=)): cp.async into shared memory, by width
    ahead = re.findall(
        r"cp\.async\.c[ag]\.shared\.global(?:\.\S+)? \[[^]]*\], \[[^]]*\], (0x[0-9a-f]+|\d+)", ptx
    )
    for size, n in collections.Counter(int(b, 0) for b in ahead).items():
        row["loads"][f"cp.async {size}B"] = n
    row.update(_ptxas(ptx, arch))
    return row


def _ptxas(ptx: str, arch: int) -> dict:
    """Registers and spills from the ptxas that came with Triton (whichever of its copies reads the PTX)."""
    import triton

    folder = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        for name in ("ptxas", "ptxas-blackwell"):
            path = os.path.join(folder, name)
            if not os.path.exists(path):
                continue
            run = subprocess.run([path, f"-arch=sm_{arch}a", "-v", src, "-o", os.path.join(tmp, "k.cubin")],
                                 capture_output=True, text=True)  # fmt: skip
            if run.returncode == 0:
                regs = re.search(r"Used (\d+) registers", run.stderr)
                spill = re.search(r"(\d+) bytes spill stores", run.stderr)
                return {"registers": int(regs.group(1)) if regs else None,
                        "spill_bytes": int(spill.group(1)) if spill else None}  # fmt: skip
    return {"registers": None, "spill_bytes": None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability (90: H100 / H200)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the interpreter does not compile", file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore")
    results = {name: compile_one(k, sig, consts, div, args.arch) for name, k, sig, consts, div in variants()}
    text = json.dumps({"arch": args.arch, "kernels": results}, indent=2)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    print(text)
    return 0 if all(r["compiles"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
