"""Perplexity: hotcold against upstream llama.cpp on the same files (issues #13 and #15).

From a PowerInfer file (default: the bundled demo model) it writes, under --work (never in the repo):

1. `dense/base.gguf`: a plain dense GGUF of the same weights (GGUF magic, the llama tensors and keys;
   no predictors, no `powerinfer.*` keys; `ffn_down_t` transposed back to `ffn_down`, exact for float
   types), which upstream llama.cpp loads;
2. `llama-quantize` outputs of it: F32, F16 and the llama.cpp types in --types (`--allow-requantize`,
   since the demo's token embedding is already Q8_0);
3. for every file, `hotcold perplexity --dense` and `llama-perplexity` on the same text, context and
   threads. Both follow llama.cpp's protocol: the text tokenized once with BOS, cut into chunks of
   exactly CTX tokens, each chunk's first token replaced by BOS, the predictions at positions
   CTX/2 .. CTX-2 scored (`hotcold/cli/perplexity.py` against `tools/perplexity/perplexity.cpp`).

Upstream's `llama` architecture always computes SiLU(gate) * up, and the demo is a ReLU model, so every
file is compared twice:
- `silu`: the very same `llama` file in both engines (hotcold too reads a dense llama file as SiLU). This
  is the engines' arithmetic on identical bytes, but not the trained model (its perplexity is poor);
- `relu`: the trained model. hotcold reads the file with `hotcold.ffn_activation = relu` added (tensor
  bytes unchanged); llama.cpp reads the same tensor bytes as upstream's `smallthinker` architecture, a
  mixture of ReLU-gated experts, with one expert (router weights zero, softmax over one expert = 1 exactly)
  and the Q/K rows of each head permuted from llama's interleaved RoPE pairs to NeoX order (the layout
  smallthinker rotates; each row keeps its bytes, so quantized rows are unchanged).

Also: a token check (llama-perplexity's `--kl-divergence-base` file holds its token ids; hotcold's
tokenizer must give the same), optionally the first chunks' per-token log-probabilities
(--logits-check), the sparse mode on PowerInfer files from `hotcold quantize` (--sparse), and with --ours
hotcold's own quantizer on the dense copy, each output run through both engines like the llama.cpp files.

    python benchmarks/perplexity_vs_llama.py --work /work/ppl --text /work/ppl/corpus/heldout.txt \\
        --llama-bin ~/.cache/hotcold-anchors/llama.cpp/build/bin -c 256 -t 2 --sparse [--ours] \
        [--hotcold-rev HEAD]

--hotcold-rev exports src/ of a commit to WORK and measures hotcold from there (the work tree is shared
with people editing the kernels). Prints JSON (also written to WORK/results.json) and a markdown table
(WORK/results.md). Runs are cached in WORK/runs/ by file, size, mtime, settings and exported commit, so a
rerun only measures what changed (--fresh: everything, --fresh-hotcold: every hotcold run).
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType

from hotcold.gguf import names
from hotcold.gguf.io import FLOAT_TYPES, ModelFile, TensorSpec, metadata_items, write_model_file

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "src" / "hotcold" / "data" / "demo.powerinfer.gguf"
LLAMA_TYPES = ["Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_0", "Q3_K_M", "Q2_K"]
BASELINE_TYPES = ["F32", "F16"]
OURS_TYPES = ["q8_0", "q6_k", "q5_k_m", "q4_k_m", "q4_0"]
SPARSE_TYPES = ["q8_0", "q6_k", "q5_k_m", "q4_k_m", "q4_0"]
# Tensors only PowerInfer files have: predictors and the hot-neuron placement
POWERINFER_ONLY = re.compile(
    r"^blk\.\d+\.(fc1|fc2|gpu_idx|gpu_bucket)\.weight$|^blk\.\d+\.(gpu_idx|gpu_bucket)$"
)
DOWN_T = re.compile(r"^(blk\.\d+)\.ffn_down_t\.weight$")
TOLERANCE = 0.005  # issue #13: the same file within 0.5% in both engines


# ---------------------------------------------------------------------------------------------------
# Files


def _copy_spec(entry, name: str | None = None) -> TensorSpec:
    return TensorSpec(name or entry.name, entry.shape, entry.qtype, lambda e=entry: np.asarray(e.data))


def dense_copy(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], *, activation: str | None = None
) -> Path:
    """A plain dense GGUF of a PowerInfer (or dense) llama file: the same keys less `powerinfer.*`, the same
    tensors less predictors and placement, `ffn_down_t` [F, D] written back as `ffn_down` [D, F] (float types:
    an exact transpose). activation adds `hotcold.ffn_activation` (for hotcold; llama.cpp ignores it)."""
    mf = ModelFile(src)
    if mf.architecture != "llama":
        raise ValueError(f"{src}: architecture {mf.architecture!r}, this script handles llama files")
    meta = [
        m for m in metadata_items(mf) if not m[0].startswith("powerinfer.") and m[0] != names.FFN_ACTIVATION
    ]
    if activation is not None:
        meta.append((names.FFN_ACTIVATION, activation, GGUFValueType.STRING, None))
    specs = []
    for name, entry in mf.tensors.items():
        if POWERINFER_ONLY.match(name):
            continue
        down = DOWN_T.match(name)
        if down is None:
            specs.append(_copy_spec(entry))
            continue
        if entry.qtype not in FLOAT_TYPES:
            raise ValueError(
                f"{src}: {name} is {entry.qtype.name}; only float ffn_down_t can be transposed exactly"
            )
        f, d = entry.shape
        specs.append(
            TensorSpec(
                f"{down.group(1)}.ffn_down.weight",
                (d, f),
                entry.qtype,
                lambda e=entry: np.ascontiguousarray(np.asarray(e.data).T),
            )
        )
    return write_model_file(dst, "llama", meta, specs, inputs=[src])


def retag(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, activation: str | None) -> Path:
    """The same file with `hotcold.ffn_activation` set to `activation` (None: removed); tensor bytes unchanged."""
    mf = ModelFile(src)
    meta = [m for m in metadata_items(mf) if m[0] != names.FFN_ACTIVATION]
    if activation is not None:
        meta.append((names.FFN_ACTIVATION, activation, GGUFValueType.STRING, None))
    return write_model_file(
        dst, mf.architecture, meta, [_copy_spec(e) for e in mf.tensors.values()], inputs=[src]
    )


def neox_rows(n_head: int, head_dim: int) -> np.ndarray:
    """Row order that turns a llama GGUF Q/K matrix (RoPE pairs (2i, 2i+1) in each head) into NeoX order
    (pairs (i, i + Dh/2)): per head rows 0, 2, .., Dh-2, then 1, 3, .., Dh-1 (the inverse of
    convert_hf_to_gguf's permute, so it is the Hugging Face layout again)."""
    if head_dim % 2:
        raise ValueError(f"head dim {head_dim} is odd: RoPE needs pairs")
    per_head = np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])
    return (np.arange(n_head)[:, None] * head_dim + per_head[None, :]).reshape(-1)


def to_smallthinker(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> Path:
    """A dense llama GGUF as upstream's `smallthinker` architecture (RMS-norm llama attention, NeoX RoPE, an
    MoE of ReLU(gate) * up experts) with a single expert, so that llama.cpp computes the ReLU model:
    ffn_{gate,up,down} become the expert tensors [1, ...] (same bytes), a zero router ffn_gate_inp gives the
    expert weight softmax([0]) = 1, and attn_q / attn_k rows are put in NeoX order (neox_rows)."""
    mf = ModelFile(src)
    md = mf.metadata
    if mf.architecture != "llama" or mf.is_sparse:
        raise ValueError(f"{src}: expected a dense llama GGUF")
    n_head = int(md["llama.attention.head_count"])
    n_head_kv = int(md.get("llama.attention.head_count_kv", n_head))
    n_embd = int(md["llama.embedding_length"])
    n_ff = int(md["llama.feed_forward_length"])
    head_dim = n_embd // n_head
    if int(md.get("llama.rope.dimension_count", head_dim)) != head_dim:
        raise ValueError(f"{src}: partial RoPE is not handled")
    meta = []
    for key, value, vtype, sub in metadata_items(mf):
        if key.startswith("hotcold.") or key == "general.architecture":
            continue
        meta.append((re.sub(r"^llama\.", "smallthinker.", key), value, vtype, sub))
    u32 = GGUFValueType.UINT32
    meta += [
        ("smallthinker.expert_count", 1, u32, None),
        ("smallthinker.expert_used_count", 1, u32, None),
        ("smallthinker.expert_feed_forward_length", n_ff, u32, None),
        ("smallthinker.expert_gating_func", 1, u32, None),  # LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
    ]
    rows = {"attn_q": neox_rows(n_head, head_dim), "attn_k": neox_rows(n_head_kv, head_dim)}
    specs = []
    for name, entry in mf.tensors.items():
        m = re.match(r"^(blk\.\d+)\.(\w+)\.weight$", name)
        kind = m.group(2) if m else None
        if kind in rows:
            order = rows[kind]
            specs.append(
                TensorSpec(name, entry.shape, entry.qtype, lambda e=entry, o=order: np.asarray(e.data)[o])
            )
        elif kind in ("ffn_gate", "ffn_up", "ffn_down"):
            if kind == "ffn_gate":  # the router comes first in the block, as in converted MoE files
                specs.append(
                    TensorSpec(
                        f"{m.group(1)}.ffn_gate_inp.weight",
                        (1, n_embd),
                        GGMLQuantizationType.F32,
                        lambda: np.zeros((1, n_embd), np.float32),
                    )
                )
            specs.append(
                TensorSpec(
                    f"{m.group(1)}.{kind}_exps.weight",
                    (1, *entry.shape),
                    entry.qtype,
                    lambda e=entry: np.asarray(e.data)[None],
                )
            )
        else:
            specs.append(_copy_spec(entry))
    return write_model_file(dst, "smallthinker", meta, specs, inputs=[src])


def type_mix(path: str | os.PathLike[str]) -> dict[str, int]:
    mix: dict[str, int] = {}
    for entry in ModelFile(path).tensors.values():
        mix[entry.qtype.name] = mix.get(entry.qtype.name, 0) + 1
    return dict(sorted(mix.items()))


# ---------------------------------------------------------------------------------------------------
# llama.cpp output


def parse_llama_perplexity(output: str) -> dict:
    """The figures llama-perplexity prints: final PPL and its +/-, chunks, n_ctx, n_seq, build."""
    final = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", output)
    over = re.search(
        r"calculating perplexity over (\d+) chunks, n_ctx=(\d+), batch_size=(\d+), n_seq=(\d+)", output
    )
    # the running estimate after the last chunk is the same figure; llama.cpp's log thread does not always flush
    # the "Final estimate" line into the pipe before the process exits (then there is no +/-)
    last = over and re.findall(rf"\[{int(over.group(1))}\]([0-9.]+)", output)
    if final is None and not last:
        tail = "\n".join(output.strip().splitlines()[-15:])
        raise RuntimeError(f"llama-perplexity printed no final estimate:\n{tail}")
    if final is not None:
        result = {"perplexity": float(final.group(1)), "pm": float(final.group(2))}
    else:
        result = {"perplexity": float(last[-1]), "pm": None}
    if over:
        result.update(chunks=int(over.group(1)), ctx=int(over.group(2)), n_seq=int(over.group(4)))
    build = re.search(r"^build: (.+)$", output, re.M)
    if build:
        result["build"] = build.group(1).strip()
    return result


def read_logits_file(path: str | os.PathLike[str]) -> tuple[int, int, np.ndarray, Iterator[np.ndarray]]:
    """llama-perplexity's --kl-divergence-base file: (n_ctx, n_vocab, tokens [n_chunk*n_ctx] as in the text,
    BOS first, not replaced), and per chunk the log-probabilities [n_ctx-1-n_ctx//2, V] of the scored
    positions, decoded from its 16-bit form (scale, min, then round((logit - min_logit) / scale))."""
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    if bytes(raw[:8]) != b"_logits_":
        raise ValueError(f"{path}: not a llama-perplexity logits file")
    n_ctx, n_vocab, n_chunk = (int(x) for x in raw[8:20].view(np.int32))
    tokens = np.array(raw[20 : 20 + 4 * n_chunk * n_ctx].view(np.int32))
    nv = 2 * ((n_vocab + 1) // 2) + 4
    n_scored = n_ctx - 1 - n_ctx // 2
    body = raw[20 + 4 * n_chunk * n_ctx :].view(np.uint16)
    if body.size != n_chunk * n_scored * nv:
        raise ValueError(f"{path}: {body.size} log-prob values, expected {n_chunk * n_scored * nv}")

    def chunks() -> Iterator[np.ndarray]:
        for c in range(n_chunk):
            rows = np.array(body[c * n_scored * nv : (c + 1) * n_scored * nv]).reshape(n_scored, nv)
            head = rows[:, :4].copy().view(np.float32)  # [n, 2]: scale, min log-prob
            q = rows[:, 4 : 4 + n_vocab].astype(np.float64)
            yield head[:, 1:2].astype(np.float64) + head[:, 0:1].astype(np.float64) * q

    return n_ctx, n_vocab, tokens, chunks()


def rel(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a / b - 1


# ---------------------------------------------------------------------------------------------------
# Running


class Runner:
    """Runs both engines, caching each result in WORK/runs by file identity and settings."""

    def __init__(self, args):
        self.args = args
        self.bin = Path(args.llama_bin).expanduser()
        self.cache = Path(args.work) / "runs"
        self.cache.mkdir(parents=True, exist_ok=True)
        self.text_sha = hashlib.sha256(Path(args.text).read_bytes()).hexdigest()

    def _cached(self, what: str, path: Path, extra: tuple, fn) -> dict:
        st = path.stat()
        snapshot = os.environ.get(SNAPSHOT_ENV) if what == "hotcold" else None
        key = json.dumps([what, str(path), st.st_size, st.st_mtime_ns, self.args.ctx, self.args.threads,
                          self.text_sha, *extra] + ([snapshot] if snapshot else []))  # fmt: skip
        file = self.cache / (hashlib.sha256(key.encode()).hexdigest()[:20] + ".json")
        stale = self.args.fresh or (what == "hotcold" and self.args.fresh_hotcold)
        if file.exists() and not stale:
            return json.loads(file.read_text())
        start = time.perf_counter()
        result = fn()
        result["wall_s"] = round(time.perf_counter() - start, 1)
        file.write_text(json.dumps(result))
        return result

    def hotcold(self, path: Path, *, dense: bool = True) -> dict:
        cmd = [sys.executable, "-m", "hotcold", "perplexity", "-m", str(path), "-f", str(self.args.text),
               "-c", str(self.args.ctx), "-t", str(self.args.threads), "--device", "cpu", "--json"]  # fmt: skip
        if dense:
            cmd.append("--dense")

        def go() -> dict:
            log(f"hotcold perplexity {'--dense ' if dense else ''}{path.name}")
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
            result = json.loads(out.stdout)
            if not self.args.layers:
                result.pop("layers", None)
            result["hotcold_tree"] = tree_state()  # the kernels are under active development
            return result

        return self._cached("hotcold", path, ("dense" if dense else "sparse",), go)

    def llama(self, path: Path, *, logits_file: Path | None = None) -> dict:
        cmd = [str(self.bin / "llama-perplexity"), "-m", str(path), "-f", str(self.args.text),
               "-c", str(self.args.ctx), "-t", str(self.args.threads), "-tb", str(self.args.threads),
               "--no-warmup"]  # fmt: skip
        if logits_file is not None:
            cmd += ["--kl-divergence-base", str(logits_file)]

        def go() -> dict:
            log(f"llama-perplexity {path.name}")
            out = subprocess.run(cmd, capture_output=True, text=True)
            text = out.stdout + out.stderr
            if out.returncode:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{text[-3000:]}")
            return parse_llama_perplexity(text)

        if logits_file is not None:  # the file is the product: never cached
            return go()
        return self._cached("llama", path, (), go)

    def quantize(self, src: Path, dst: Path, qtype: str) -> Path:
        if dst.exists() and dst.stat().st_mtime_ns > src.stat().st_mtime_ns and not self.args.fresh:
            return dst
        log(f"llama-quantize {qtype}")
        cmd = [str(self.bin / "llama-quantize"), "--allow-requantize", str(src), str(dst), qtype,
               str(self.args.threads)]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{(out.stdout + out.stderr)[-3000:]}")
        return dst

    def hotcold_quantize(self, src: Path, dst: Path, qtype: str) -> Path | str:
        """Our quantizer; the error text when it refuses the type (the K-quant writer may not exist yet)."""
        if dst.exists() and dst.stat().st_mtime_ns > src.stat().st_mtime_ns and not self.args.fresh:
            return dst
        log(f"hotcold quantize {src.name} {qtype}")
        dst.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "hotcold", "quantize", str(src), str(dst), qtype]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            return (out.stderr.strip().splitlines() or ["failed"])[-1]
        return dst


SNAPSHOT_ENV = "PPL_HOTCOLD_SNAPSHOT"  # set when hotcold runs from an exported commit (--hotcold-rev)


def tree_state() -> str:
    """The hotcold code measured: the exported commit (--hotcold-rev), else HEAD of the repository plus
    `+dirty` and the changed files under src/ when the work tree differs."""
    if os.environ.get(SNAPSHOT_ENV):
        return f"{os.environ[SNAPSHOT_ENV]} (exported commit)"
    head = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    dirty = subprocess.run(
        ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=all", "--", "src"],
        capture_output=True,
        text=True,
    ).stdout.split("\n")
    changed = sorted(line[3:] for line in dirty if line.strip())
    return head.stdout.strip() + (f"+dirty ({', '.join(changed)})" if changed else "")


def tagged(folder: str) -> str:
    """A folder name for files our quantizer wrote: one per exported commit."""
    sha = os.environ.get(SNAPSHOT_ENV)
    return f"{folder}-{sha}" if sha else folder


def same_tensors(a: Path, b: Path) -> bool:
    """Every tensor of two files has the same name, type and bytes (keys may differ)."""
    fa, fb = ModelFile(a), ModelFile(b)
    if fa.tensors.keys() != fb.tensors.keys():
        return False
    return all(
        e.qtype == fb.tensors[n].qtype and np.array_equal(np.asarray(e.data), np.asarray(fb.tensors[n].data))
        for n, e in fa.tensors.items()
    )


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def derived(run: Runner, path: Path, work: Path) -> tuple[Path, Path]:
    """(the hotcold ReLU file, the llama.cpp smallthinker file) for a dense llama file."""
    relu, st = work / "relu" / f"{path.stem}.relu.gguf", work / "st" / f"{path.stem}.st.gguf"
    for out, make in (
        (relu, lambda: retag(path, relu, activation="relu")),
        (st, lambda: to_smallthinker(path, st)),
    ):
        out.parent.mkdir(parents=True, exist_ok=True)
        if run.args.fresh or not out.exists() or out.stat().st_mtime_ns < path.stat().st_mtime_ns:
            make()
    return relu, st


def compare(run: Runner, files: list[tuple[str, str, Path]], work: Path) -> list[dict]:
    """Both engines on every (source, type, file), SiLU (same file) and ReLU (hotcold tag / smallthinker)."""
    rows = []
    for source, qtype, path in files:
        relu, st = derived(run, path, work)
        for activation, h_file, l_file in (("relu", relu, st), ("silu", path, path)):
            if activation not in run.args.activations:
                continue
            h, l_ = run.hotcold(h_file), run.llama(l_file)
            rows.append(
                {
                    "source": source,
                    "type": qtype,
                    "activation": activation,
                    "file": str(path),
                    "bytes": path.stat().st_size,
                    "type_mix": type_mix(path),
                    "hotcold": h["perplexity"],
                    "llama": l_["perplexity"],
                    "llama_pm": l_["pm"],
                    "diff": rel(h["perplexity"], l_["perplexity"]),
                    "chunks": [h["chunks"], l_.get("chunks")],
                    "tokens_scored": h["tokens_scored"],
                    "seconds": [h.get("wall_s"), l_.get("wall_s")],
                }
            )
    for row in rows:  # each engine against its own F16 (same activation)
        base = next((b for b in rows if b["type"] == "F16" and b["source"] == "llama-quantize"
                     and b["activation"] == row["activation"]), None)  # fmt: skip
        row["hotcold_vs_f16"] = rel(row["hotcold"], base and base["hotcold"])
        row["llama_vs_f16"] = rel(row["llama"], base and base["llama"])
        row["within_tolerance"] = abs(row["diff"]) <= TOLERANCE
    return rows


def token_check(run: Runner, path: Path, work: Path, chunks: int) -> dict:
    """llama-perplexity's token ids (from its logits file) against hotcold's tokenizer on the same text, and
    over the first `chunks` chunks the per-token log-probabilities of both engines on the same file."""
    import torch

    import hotcold
    from hotcold.cli.perplexity import scoring_chunks
    from hotcold.placement.profile import corpus_tokens, read_corpus

    logits_file = work / "llama_logits.bin"
    run.llama(path, logits_file=logits_file)
    n_ctx, _, llama_tokens, llama_chunks = read_logits_file(logits_file)
    llm = hotcold.load(path, dense=True, threads=run.args.threads, device="cpu")
    tok = llm.tokenizer
    ids = corpus_tokens(tok, read_corpus(run.args.text), source=str(run.args.text))
    ours = ([tok.bos_id] if tok.add_bos else []) + ids
    n = len(llama_tokens)
    first_diff = next((i for i in range(min(n, len(ours))) if ours[i] != llama_tokens[i]), None)
    result = {
        "file": str(path),
        "hotcold_tokens": len(ours),
        "llama_tokens_compared": n,
        "tokens_identical": first_diff is None and len(ours) >= n,
        "first_difference": first_diff,
    }
    if chunks:
        first = n_ctx // 2
        diffs, top_same, count = [], 0, 0
        ours_chunks = scoring_chunks(ids, n_ctx, tok.bos_id if tok.add_bos else None)[:chunks]
        for chunk, lp in zip(ours_chunks, llama_chunks):
            logp = torch.log_softmax(llm.logits(chunk).double(), dim=-1)[first : n_ctx - 1].numpy()
            targets = np.array(chunk[first + 1 :])
            rows = np.arange(len(targets))
            diffs.append(logp[rows, targets] - lp[rows, targets])
            top_same += int((logp.argmax(1) == lp.argmax(1)).sum())
            count += len(targets)
        d = np.concatenate(diffs)
        result["logprob_check"] = {
            "chunks": len(ours_chunks),
            "tokens": count,
            "mean_nll_diff": float(-d.mean()),  # hotcold minus llama.cpp, nats per token
            "max_abs_logprob_diff": float(np.abs(d).max()),
            "top1_agreement": top_same / count,
            "note": "llama.cpp's log-probs are stored in 16 bits (steps of <= 16/65535 nats)",
        }
    logits_file.unlink()
    return result


def sparse_rows(run: Runner, source: Path, work: Path, types: list[str]) -> list[dict]:
    """hotcold's sparse mode on the PowerInfer file and its `hotcold quantize` copies (dense pass beside it)."""
    files = [("F16 (bundled)", source)]
    for qtype in types:
        out = run.hotcold_quantize(source, work / tagged("sparse") / f"demo.{qtype}.powerinfer.gguf", qtype)
        files.append((qtype.upper(), out))
    rows = []
    for label, path in files:
        if isinstance(path, str):
            rows.append({"type": label, "error": path})
            continue
        r = run.hotcold(path, dense=False)
        rows.append(
            {
                "type": label,
                "file": str(path),
                "bytes": path.stat().st_size,
                "dense": r["dense_perplexity"],
                "sparse": r["perplexity"],
                "sparse_vs_dense": r["perplexity_increase"],
                "recall_mean": r["recall_mean"],
                "precision_mean": r["precision_mean"],
                "selection_ratio": r["selection_ratio"],
                "true_firing_rate": r["true_firing_rate"],
                "computed_rate": r["firing_rate"],
                **({"layers": r["layers"]} if "layers" in r else {}),
            }
        )
    base = rows[0].get("dense")
    for row in rows:
        if "dense" in row:
            row["dense_vs_f16"] = rel(row["dense"], base)
    return rows


# ---------------------------------------------------------------------------------------------------
# Report


def pct(x: float | None, digits: int = 2) -> str:
    return "—" if x is None else f"{100 * x:+.{digits}f}%"


def markdown(result: dict) -> str:
    lines = [
        "| source | type | act | size | hotcold ppl | llama.cpp ppl (±) | hotcold / llama.cpp | hotcold vs F16 | llama.cpp vs F16 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["rows"]:
        flag = "" if r["within_tolerance"] else " **over 0.5%**"
        lines.append(
            f"| {r['source']} | {r['type']} | {r['activation']} | {r['bytes'] / 1e6:.1f} MB | {r['hotcold']:.4f} "
            f"| {r['llama']:.4f} (±{r['llama_pm']:.2f}) | {pct(r['diff'], 3)}{flag} | {pct(r['hotcold_vs_f16'])} "
            f"| {pct(r['llama_vs_f16'])} |"
        )
    same = result.get("ours_tensors_identical_to_llama_quantize", {})
    if same:
        lines.append(
            "\n`hotcold quantize` output tensors byte-identical to llama-quantize's: "
            + ", ".join(f"{t} {'yes' if v else '**no**'}" for t, v in same.items())
        )
    for note in result.get("ours_skipped", []):
        lines.append(f"\n`hotcold quantize` {note}")
    if result.get("sparse"):
        lines += [
            "",
            "| PowerInfer file | size | dense ppl | sparse ppl | sparse vs dense | dense vs F16 | recall | precision "
            "| selected / firing | firing | computed |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in result["sparse"]:
            if "error" in r:
                lines.append(f"| {r['type']} | `hotcold quantize` refused: {r['error']} |")
                continue
            lines.append(
                f"| {r['type']} | {r['bytes'] / 1e6:.1f} MB | {r['dense']:.4f} | {r['sparse']:.4f} "
                f"| {pct(r['sparse_vs_dense'], 3)} | {pct(r['dense_vs_f16'])} | {r['recall_mean']:.4f} "
                f"| {r['precision_mean']:.4f} | {r['selection_ratio']:.3f}x | {100 * r['true_firing_rate']:.1f}% "
                f"| {100 * r['computed_rate']:.1f}% |"
            )
    return "\n".join(lines) + "\n"


def machine() -> dict:
    model = platform.processor() or platform.machine()
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    commit = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return {"cpu": model, "cores": os.cpu_count(), "hotcold_commit": commit.stdout.strip() or None}


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="perplexity of the same GGUF files in hotcold and upstream llama-perplexity (JSON out)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--work", required=True, help="folder for every file this writes (not in the repository)")
    p.add_argument("--text", required=True, help="held-out text to score (UTF-8)")
    p.add_argument("--model", default=str(DEMO), help="PowerInfer (or dense) llama file to start from")
    p.add_argument("--llama-bin", default="~/.cache/hotcold-anchors/llama.cpp/build/bin",
                   help="folder with llama-quantize and llama-perplexity")  # fmt: skip
    p.add_argument("-c", "--ctx", type=int, default=256, help="chunk length in tokens, both engines")
    p.add_argument("-t", "--threads", type=int, default=2, help="threads, both engines")
    p.add_argument("--types", default=",".join(LLAMA_TYPES), help="llama-quantize types (F32, F16 always)")
    p.add_argument("--activations", default="relu,silu", help="relu (the trained model), silu (same file)")
    p.add_argument("--ours", action="store_true",
                   help=f"also hotcold quantize the dense copy to {','.join(OURS_TYPES)} and compare those")  # fmt: skip
    p.add_argument("--ours-types", default=",".join(OURS_TYPES))
    p.add_argument("--sparse", action="store_true", help="sparse mode on hotcold-quantized PowerInfer files")
    p.add_argument("--sparse-types", default=",".join(SPARSE_TYPES))
    p.add_argument("--logits-check", type=int, default=4, metavar="N",
                   help="compare per-token log-probs of both engines on the first N chunks of F16 (0: tokens only)")  # fmt: skip
    p.add_argument("--layers", action="store_true", help="keep per-layer sparse statistics in the JSON")
    p.add_argument("--hotcold-rev", metavar="REV",
                   help="measure hotcold as committed at REV (exported to WORK), not the live work tree")  # fmt: skip
    p.add_argument("--fresh", action="store_true", help="ignore cached runs and files in --work")
    p.add_argument(
        "--fresh-hotcold",
        action="store_true",
        help="rerun every hotcold measurement (cached llama.cpp runs kept)",
    )
    args = p.parse_args(argv)
    args.activations = [a for a in args.activations.split(",") if a]
    work = Path(args.work).resolve()
    if work == REPO or REPO in work.parents:
        p.error(f"--work {work} is inside the repository; use a folder outside it")
    return args


def run_from_commit(rev: str, work: Path, argv: list[str]) -> None:
    """Export src/ of `rev` to WORK/hotcold-SHA and run this script again with it first on PYTHONPATH, so
    every hotcold figure comes from one committed state while others edit the work tree."""
    sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", rev], capture_output=True, text=True,
                         check=True).stdout.strip()  # fmt: skip
    snap = work / f"hotcold-{sha}"
    if not (snap / "src" / "hotcold").is_dir():
        tmp = work / f".hotcold-{sha}.tmp"
        subprocess.run(["rm", "-rf", str(tmp)], check=True)
        tmp.mkdir(parents=True)
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", sha, "src"], capture_output=True, check=True
        )
        subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive.stdout, check=True)
        tmp.rename(snap)
    env = dict(os.environ, **{SNAPSHOT_ENV: sha})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(snap / "src"), str(REPO), env.get("PYTHONPATH")]))
    log(f"hotcold from commit {sha} ({snap / 'src'})")
    os.execve(sys.executable, [sys.executable, str(Path(__file__).resolve()), *argv], env)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    if args.hotcold_rev and not os.environ.get(SNAPSHOT_ENV):
        run_from_commit(args.hotcold_rev, work, argv)
    run = Runner(args)
    base = work / "dense" / "base.gguf"
    base.parent.mkdir(exist_ok=True)
    if args.fresh or not base.exists() or base.stat().st_mtime_ns < Path(args.model).stat().st_mtime_ns:
        log(f"dense copy of {args.model}")
        dense_copy(args.model, base)
    files = [("copy", "as converted", base)]
    qdir = work / "llama-quantize"
    qdir.mkdir(exist_ok=True)
    for qtype in BASELINE_TYPES + [t for t in args.types.split(",") if t and t not in BASELINE_TYPES]:
        files.append(("llama-quantize", qtype, run.quantize(base, qdir / f"demo.{qtype}.gguf", qtype)))
    ours_skipped: list[str] = []
    ours_same: dict[str, bool] = {}  # our file's tensors byte-identical to llama-quantize's of that type
    if args.ours:
        for qtype in args.ours_types.split(","):
            out = run.hotcold_quantize(base, work / tagged("ours") / f"ours.{qtype}.gguf", qtype)
            if isinstance(out, str):
                ours_skipped.append(f"{qtype}: {out}")
                continue
            files.append(("hotcold quantize", qtype.upper(), out))
            twin = qdir / f"demo.{qtype.upper()}.gguf"
            if twin.exists():
                ours_same[qtype.upper()] = same_tensors(out, twin)
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    result = {
        "date": started,
        "machine": machine(),
        "model": str(args.model),
        "text": {"path": str(args.text), "sha256": run.text_sha, "bytes": Path(args.text).stat().st_size},
        "ctx": args.ctx,
        "threads": args.threads,
        "protocol": "llama.cpp: chunks of ctx tokens, first token BOS, positions ctx/2 .. ctx-2 scored",
        "tolerance": TOLERANCE,
        "hotcold_tree_at_start": tree_state(),
    }
    # the same file in both engines: the F16 llama file (SiLU in both)
    result["token_check"] = token_check(run, qdir / "demo.F16.gguf", work, args.logits_check)
    result["rows"] = compare(run, files, work)
    result["ours_skipped"] = ours_skipped
    result["ours_tensors_identical_to_llama_quantize"] = ours_same
    if args.sparse:
        result["sparse"] = sparse_rows(
            run, Path(args.model), work, [t for t in args.sparse_types.split(",") if t]
        )
    version = subprocess.run([str(run.bin / "llama-perplexity"), "--version"], capture_output=True, text=True)
    result["llama_version"] = " ".join((version.stdout + version.stderr).split())
    result["hotcold_tree_at_end"] = tree_state()
    if result["hotcold_tree_at_end"] != result["hotcold_tree_at_start"]:
        log("warning: the hotcold tree changed during the run; rerun with --fresh-hotcold for one state")
    (work / "results.json").write_text(json.dumps(result, indent=2))
    (work / "results.md").write_text(markdown(result))
    print(json.dumps(result, indent=2))
    print(markdown(result), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
