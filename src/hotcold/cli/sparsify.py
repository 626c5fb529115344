"""hotcold sparsify: a dense SwiGLU model -> thresholded activation sparsity, calibrated on a corpus
(training-free, CATS / WINA-weighted; see hotcold.convert.sparsify)."""

from __future__ import annotations

import json
import sys


def add_args(p) -> None:
    p.add_argument("-m", "--model", required=True, help="dense SwiGLU model file (.gguf)")
    p.add_argument("-f", "--file", required=True, help="calibration corpus (UTF-8 text)")
    p.add_argument("-o", "--outfile", required=True, help="output file (never the input)")
    p.add_argument(
        "--sparsity", type=float, default=0.5, help="target share of FFN neurons skipped per token, in (0, 1)"
    )
    p.add_argument(
        "--method",
        choices=("cats", "wina"),
        default="wina",
        help="score: wina (default) |silu(gate)| x the norm of the neuron's down-projection column; cats "
        "|silu(gate)|",
    )
    p.add_argument("--max-tokens", type=int, default=None, help="calibration tokens (default 16384)")
    p.add_argument("-c", "--ctx-size", type=int, default=None, help="window length (default 512)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads")
    p.add_argument(
        "--transpose-type",
        "--down-type",
        dest="transpose_type",
        default="auto",
        help="type of the transposed copies the sparse decode reads (ffn_down_t; ffn_gate_t, attn_qkv_t and "
        "attn_output_t where made): auto (default: Q8_0 for F32/F16/BF16 sources, else the source's type), "
        "same (the source's type; block types re-quantized along the new rows), f32, f16, bf16, q8_0, q4_0, "
        "q4_k, q6_k",
    )
    p.add_argument(
        "--gate-probe",
        choices=("auto", "none", "q4_0", "inputs"),
        default="auto",
        help="q4_0: score neurons with a Q4_0 copy of the gate (read whole) and gather the exact gate of the "
        "kept rows only: fewer bytes per token; inputs: the gate from each token's input channels over a "
        "threshold (TEAL), its product the score and the activation: fewer bytes still, a little less "
        "accurate; auto (default): q4_0 for F32/F16/BF16 gates",
    )
    p.add_argument(
        "--attention",
        action="store_true",
        help="also skip input channels of q/k/v and o per token (TEAL's rule, weighted as --method says): "
        "adds transposed copies of the attention matrices; --sparsity at load sets both shares",
    )
    p.add_argument("--json", action="store_true", help="print what was written as JSON")


def run(args) -> int:
    from hotcold.convert.sparsify import DEFAULT_TOKENS, sparsify_file

    result = sparsify_file(
        args.model,
        args.outfile,
        args.file,
        sparsity=args.sparsity,
        method=args.method,
        max_tokens=args.max_tokens or DEFAULT_TOKENS,
        ctx=args.ctx_size,
        threads=args.threads,
        transposes=args.transpose_type,
        probe=args.gate_probe,
        attention=args.attention,
        progress=not args.json,
    )
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(
        f"hotcold: wrote {result['file']}: {result['method']} thresholds for sparsity {result['sparsity']:g} "
        f"from {result['calibration_tokens']} tokens (kept on the calibration text: "
        f"{100 * (1 - result['calibration_sparsity']):.1f}% of FFN neurons)"
        f"{', attention inputs too' if result['attention_inputs'] else ''}, ffn_down_t {result['ffn_down_t_type']}, "
        f"{result['seconds']:.1f} s",
        file=sys.stderr,
    )
    return 0
