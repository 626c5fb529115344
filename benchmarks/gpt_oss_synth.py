"""gpt-oss-like synthetic decode with MXFP4 experts, side by side: hotcold against upstream llama.cpp's llama-bench
on the same MXFP4_MOE file, optionally with an older hotcold checkout (--before-src) in the same rounds.

The file: arch `gpt-oss`, gpt-oss-20b's layer (width 2880, 64 heads of 64, 8 KV heads, experts of 2880, top-4,
q/k/v/o and expert biases, attention sinks, a window of 128 on even layers, YaRN) with fewer layers and experts
(4 layers of 16 experts: a token reads what it reads in gpt-oss-20b per layer, 4 experts) and a 32,000-token
vocabulary (gpt-oss's 201,088-row Q8_0 head alone would be 2/3 of a token's bytes here). Random weights written
F16, then `llama-quantize ... MXFP4_MOE` (experts MXFP4, every other matrix Q8_0): the file users download.

Effective GB/s: the weight bytes one token reads (attention, router, 4 experts of each layer, output head) times
tokens/s. Every timing run is wrapped in `flock /tmp/hotcold-bench.lock`; interleaved rounds, medians.

    python benchmarks/gpt_oss_synth.py --dir /tmp/gptoss-bench [--before-src OLD/src] [--rounds 3] [--n-gen 32]
        [--threads 2] [--small] [--out J]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks.synth, run as a script

from benchmarks.smallthinker_synth import BIN, LOCK, llama_tg, locked  # noqa: E402

SHAPE = dict(n_layer=4, n_embd=2880, n_head=64, n_head_kv=8, head_dim=64, n_expert=16, n_used=4, n_ff=2880,
             n_vocab=32000)  # fmt: skip
WINDOW = 128


def synthesize(out: Path, *, seed: int = 0, n_layer: int, n_embd: int, n_head: int, n_head_kv: int, head_dim: int,
               n_expert: int, n_used: int, n_ff: int, n_vocab: int) -> Path:  # fmt: skip
    """The F16 gpt-oss-like file (see the module docstring)."""
    from benchmarks.synth import vocab_metadata
    from hotcold.gguf.io import TensorSpec, write_model_file

    arch, D, F, E = "gpt-oss", n_embd, n_ff, n_expert
    rng = np.random.default_rng(seed)

    def f16(shape, std):
        return lambda: (rng.standard_normal(shape, dtype=np.float32) * std).astype(np.float16)

    def f32(shape, std):
        return lambda: rng.standard_normal(shape, dtype=np.float32) * std

    ones = lambda n: lambda: np.ones(n, np.float32)  # noqa: E731
    s_in, s_small = 1 / np.sqrt(D), 0.1 / np.sqrt(D)
    qd, kvd = n_head * head_dim, n_head_kv * head_dim
    specs = [TensorSpec("token_embd.weight", (n_vocab, D), Q.F16, f16((n_vocab, D), 1.0))]
    for i in range(n_layer):
        b = f"blk.{i}."
        specs += [
            TensorSpec(b + "attn_norm.weight", (D,), Q.F32, ones(D)),
            TensorSpec(b + "attn_q.weight", (qd, D), Q.F16, f16((qd, D), s_in)),
            TensorSpec(b + "attn_q.bias", (qd,), Q.F32, f32((qd,), 0.02)),
            TensorSpec(b + "attn_k.weight", (kvd, D), Q.F16, f16((kvd, D), s_in)),
            TensorSpec(b + "attn_k.bias", (kvd,), Q.F32, f32((kvd,), 0.02)),
            TensorSpec(b + "attn_v.weight", (kvd, D), Q.F16, f16((kvd, D), s_in)),
            TensorSpec(b + "attn_v.bias", (kvd,), Q.F32, f32((kvd,), 0.02)),
            TensorSpec(b + "attn_output.weight", (D, qd), Q.F16, f16((D, qd), s_small)),
            TensorSpec(b + "attn_output.bias", (D,), Q.F32, f32((D,), 0.02)),
            TensorSpec(b + "attn_sinks.weight", (n_head,), Q.F32, f32((n_head,), 1.0)),
            TensorSpec(b + "post_attention_norm.weight", (D,), Q.F32, ones(D)),
            TensorSpec(b + "ffn_gate_inp.weight", (E, D), Q.F16, f16((E, D), s_in)),
            TensorSpec(b + "ffn_gate_inp.bias", (E,), Q.F32, f32((E,), 0.1)),
            TensorSpec(b + "ffn_gate_exps.weight", (E, F, D), Q.F16, f16((E, F, D), s_in)),
            TensorSpec(b + "ffn_gate_exps.bias", (E, F), Q.F32, f32((E, F), 0.02)),
            TensorSpec(b + "ffn_up_exps.weight", (E, F, D), Q.F16, f16((E, F, D), s_in)),
            TensorSpec(b + "ffn_up_exps.bias", (E, F), Q.F32, f32((E, F), 0.02)),
            TensorSpec(b + "ffn_down_exps.weight", (E, D, F), Q.F16, f16((E, D, F), 0.1 / np.sqrt(F))),
            TensorSpec(b + "ffn_down_exps.bias", (E, D), Q.F32, f32((E, D), 0.02)),
        ]
    specs += [
        TensorSpec("output_norm.weight", (D,), Q.F32, ones(D)),
        TensorSpec("output.weight", (n_vocab, D), Q.F16, f16((n_vocab, D), s_in)),
    ]
    meta = [
        ("general.name", "gpt-oss-20b-like-synthetic", V.STRING),
        (f"{arch}.block_count", n_layer, V.UINT32),
        (f"{arch}.context_length", 131072, V.UINT32),
        (f"{arch}.embedding_length", D, V.UINT32),
        (f"{arch}.feed_forward_length", F, V.UINT32),
        (f"{arch}.expert_feed_forward_length", F, V.UINT32),
        (f"{arch}.attention.head_count", n_head, V.UINT32),
        (f"{arch}.attention.head_count_kv", n_head_kv, V.UINT32),
        (f"{arch}.attention.key_length", head_dim, V.UINT32),
        (f"{arch}.attention.value_length", head_dim, V.UINT32),
        (f"{arch}.attention.layer_norm_rms_epsilon", 1e-5, V.FLOAT32),
        (f"{arch}.attention.sliding_window", WINDOW, V.UINT32),
        (f"{arch}.rope.freq_base", 150000.0, V.FLOAT32),
        (f"{arch}.rope.scaling.type", "yarn", V.STRING),
        (f"{arch}.rope.scaling.factor", 32.0, V.FLOAT32),
        (f"{arch}.rope.scaling.original_context_length", 4096, V.UINT32),
        (f"{arch}.expert_count", E, V.UINT32),
        (f"{arch}.expert_used_count", n_used, V.UINT32),
        ("general.file_type", 1, V.UINT32),
        *vocab_metadata(n_vocab),
    ]
    return write_model_file(out, arch, meta, specs)


def token_bytes(path: Path) -> int:
    """Weight bytes one decode token reads: every matrix but the embedding, each expert matrix n_used / E of it."""
    from hotcold.gguf.io import ModelFile

    mf = ModelFile(path)
    used, n_expert = (mf.metadata[f"gpt-oss.expert_{k}"] for k in ("used_count", "count"))
    total = 0
    for name, e in mf.tensors.items():
        if name == "token_embd.weight" or len(e.shape) < 2:
            continue
        total += e.data.nbytes * used // n_expert if "_exps." in name else e.data.nbytes
    return total


def hotcold_tg(path: Path, threads: int, n_gen: int, src: str | None = None) -> dict:
    cmd = [sys.executable, "-m", "hotcold", "bench", "-m", str(path), "-p", "0", "-n", str(n_gen), "-r", "1",
           "-t", str(threads), "--mode", "dense", "--json"]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=src) if src else None
    rows = json.loads(locked(cmd, cwd="/tmp", env=env).stdout)
    return next(r for r in rows if r["test"].startswith("tg"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--dir", type=Path, required=True, help="where the F16 and MXFP4_MOE files are written (or reused)"
    )
    ap.add_argument("--before-src", default=None, help="an older checkout's src/ timed in the same rounds")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--n-gen", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--small", action="store_true", help="a 1-layer, 4-expert version (to try the script)")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    ap.add_argument("--n-expert", type=int, default=None, help="experts a layer (default 16; the larger-than-memory "
                    "runs of benchmarks/memory.py take 32: a file twice the size, the same bytes a token)")  # fmt: skip
    ap.add_argument("--n-vocab", type=int, default=None, help="vocabulary rows (default 32,000)")
    ap.add_argument("--make-only", action="store_true", help="write the files and stop")
    args = ap.parse_args()
    shape = dict(SHAPE, n_layer=1, n_expert=4, n_embd=512, n_ff=512) if args.small else dict(SHAPE)
    shape.update({k: v for k, v in (("n_expert", args.n_expert), ("n_vocab", args.n_vocab)) if v})
    args.dir.mkdir(parents=True, exist_ok=True)
    tag = "".join(
        f"-{k[2:]}{shape[k]}" for k in ("n_expert", "n_vocab") if shape[k] != SHAPE[k] and not args.small
    )
    f16 = args.dir / ("small-f16.gguf" if args.small else f"f16{tag}.gguf")
    mxfp4 = f16.with_name(f16.name.replace("f16", "mxfp4_moe"))
    if not mxfp4.exists():
        if not f16.exists():
            synthesize(f16, **shape)
        subprocess.run([str(BIN / "llama-quantize"), str(f16), str(mxfp4), "MXFP4_MOE"], check=True,
                       capture_output=True)  # fmt: skip
    if args.make_only:
        print(mxfp4)
        return
    nbytes = token_bytes(mxfp4)
    sides = {"llama.cpp": [], "hotcold": [], **({"hotcold_before": []} if args.before_src else {})}
    for _ in range(args.rounds):  # interleaved
        sides["llama.cpp"].append(llama_tg(mxfp4, args.threads, args.n_gen))
        sides["hotcold"].append(float(hotcold_tg(mxfp4, args.threads, args.n_gen)["tokens_per_s"]))
        if args.before_src:
            row = hotcold_tg(mxfp4, args.threads, args.n_gen, args.before_src)
            sides["hotcold_before"].append(float(row["tokens_per_s"]))
    med = {k: statistics.median(v) for k, v in sides.items()}
    load = os.getloadavg()
    result = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores (load average "
        f"{load[0]:.2f} at the end; runs under flock {LOCK})",
        "file": str(mxfp4),
        "shape": shape,
        "threads": args.threads,
        "n_gen": args.n_gen,
        "rounds": args.rounds,
        "weight_bytes_per_token": nbytes,
        "tg_tps": sides,
        "median_tps": med,
        "effective_gbps": {k: round(v * nbytes / 1e9, 2) for k, v in med.items()},
        "hotcold_over_llama_cpp": med["hotcold"] / med["llama.cpp"],
        **({"hotcold_over_before": med["hotcold"] / med["hotcold_before"]} if args.before_src else {}),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
