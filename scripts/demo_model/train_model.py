"""Train the bundled demo model: a small LLaMA-architecture ReLU model, on the CPU.

``LlamaForCausalLM(hidden_act="relu")``: hidden 256, 8 layers, 8 heads (4 KV heads), FFN width
1024 (a multiple of 256 above 1000, so PowerInfer itself can run it), vocabulary 8192, context 512,
about 12 M parameters. Training: rows of 256 tokens (BOS + 255 tokens of text starting at a
sentence), batch 4, AdamW (lr 1.5e-3, betas 0.9/0.95, weight decay 0.1 on matrices), linear
warm-up then cosine decay to a tenth, gradient clipping at 1.0, bf16 autocast over fp32 master
weights.

Budget: ``--minutes`` of wall-clock time (default 20) and/or ``--tokens``; training stops at
whichever comes first, and the learning-rate schedule follows the fraction of the budget spent,
so a shorter budget still ends with a decayed learning rate. A pure token budget
(``--minutes 0 --tokens N``) makes a run repeatable; a wall-clock budget does not (how far it gets
depends on the machine's load).

Output (``--out``, default /work/demo_build/hf), written to a temporary folder and renamed into
place, so an interrupted run never leaves a half checkpoint under the final name:

- ``config.json``, ``generation_config.json``, ``model.safetensors`` (fp32),
- the tokenizer files from ``--tokenizer`` (``train_tokenizer.py``),
- ``train_log.json``: parameters, tokens seen, minutes, held-out loss and perplexity (fp32, no
  autocast), FFN sparsity per layer on held-out text (fraction of exact zeros in ``relu(gate(x))``),
  and the loss history.

Every ``--checkpoint-minutes`` the training state (weights, optimizer, step, RNG states, time spent)
is saved to ``--state`` (also via a temporary file); ``--resume`` continues from it.

Usage::

    python scripts/demo_model/train_model.py --corpus /work/demo_build/corpus \\
        --tokenizer /work/demo_build/tokenizer --out /work/demo_build/hf --minutes 20
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import time
from pathlib import Path

import numpy as np
import sentencepiece as spm
import torch
from transformers import LlamaConfig, LlamaForCausalLM

TOKENIZER_FILES = ("tokenizer.model", "tokenizer_config.json", "special_tokens_map.json")
WINDOW_CHARS = 2000  # text encoded per row; ~4 characters per token, so well over 255 tokens

# A row starts at a sentence: the start of a line, or the word after . ! ? ; : (and closing quotes).
# Starting after a space gives exactly the tokens the word has in context ("▁Word").
_SENTENCE_START = re.compile(r"(?:\A|\n|[.!?;:][\"')\]]* )(?=\S)")


def model_config(args: argparse.Namespace, vocab_size: int) -> LlamaConfig:
    return LlamaConfig(
        hidden_act="relu",
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        intermediate_size=args.ffn,
        vocab_size=vocab_size,
        max_position_embeddings=512,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=None,
    )


class TextRows:
    """Rows of BOS + (seq - 1) tokens of `text`, each starting at a sentence start."""

    def __init__(self, text: str, sp: spm.SentencePieceProcessor, seq: int) -> None:
        self.text, self.sp, self.seq = text, sp, seq
        starts = np.fromiter((m.end() for m in _SENTENCE_START.finditer(text)), dtype=np.int64)
        self.starts = starts[starts + WINDOW_CHARS <= len(text)]
        if len(self.starts) == 0:
            raise ValueError(f"text of {len(text)} characters is shorter than one row ({WINDOW_CHARS})")

    def row(self, start: int) -> list[int]:
        n_chars = WINDOW_CHARS
        while True:
            ids = self.sp.encode(self.text[start : start + n_chars])
            if len(ids) >= self.seq - 1 or start + n_chars >= len(self.text):
                break
            n_chars *= 2
        ids = [self.sp.bos_id()] + ids[: self.seq - 1]
        if len(ids) != self.seq:
            raise ValueError(f"row at character {start} has {len(ids)} tokens, expected {self.seq}")
        return ids

    def sample(self, rng: np.random.Generator, batch: int) -> torch.Tensor:
        picks = rng.integers(0, len(self.starts), size=batch)
        return torch.tensor([self.row(int(self.starts[i])) for i in picks])  # [B, S]

    def evenly_spaced(self, n: int) -> torch.Tensor:
        """n rows spread evenly over the text (deterministic: the held-out set)."""
        idx = np.linspace(0, len(self.starts) - 1, num=min(n, len(self.starts))).round().astype(np.int64)
        return torch.tensor([self.row(int(self.starts[i])) for i in idx])  # [N, S]


def lr_at(step: int, progress: float, args: argparse.Namespace) -> float:
    """Linear warm-up over `warmup_steps`, then cosine from lr to lr/10 over the budget fraction."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    floor = args.lr * 0.1
    return floor + 0.5 * (args.lr - floor) * (1.0 + math.cos(math.pi * min(progress, 1.0)))


@torch.no_grad()
def heldout_loss(model: LlamaForCausalLM, rows: torch.Tensor, *, bf16: bool, batch: int = 8) -> float:
    """Mean next-token loss over all predicted tokens of `rows` [N, S]."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(rows), batch):
        x = rows[i : i + batch]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=x).logits  # [B, S, V]
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].float().flatten(0, 1), x[:, 1:].flatten(), reduction="sum"
        )
        total += loss.item()
        count += x[:, 1:].numel()
    model.train()
    return total / count


@torch.no_grad()
def ffn_sparsity(model: LlamaForCausalLM, rows: torch.Tensor, *, batch: int = 8) -> list[dict]:
    """Per layer, on `rows` in fp32: fraction of exact zeros in relu(gate(x)), and dead neurons."""
    layers = model.model.layers
    zeros = [0] * len(layers)
    total = [0] * len(layers)
    fired = [torch.zeros(model.config.intermediate_size, dtype=torch.bool) for _ in layers]

    def hook(i: int):
        def record(_module, _inputs, out: torch.Tensor) -> None:  # out: [B, S, F]
            zeros[i] += int((out == 0).sum())
            total[i] += out.numel()
            fired[i] |= (out > 0).flatten(0, -2).any(0)

        return record

    handles = [layer.mlp.act_fn.register_forward_hook(hook(i)) for i, layer in enumerate(layers)]
    model.eval()
    try:
        for i in range(0, len(rows), batch):
            model(input_ids=rows[i : i + batch])
    finally:
        for h in handles:
            h.remove()
        model.train()
    return [
        {"layer": i, "sparsity": zeros[i] / total[i], "never_fired": int((~fired[i]).sum())}
        for i in range(len(layers))
    ]


def save_state(path: Path, state: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def save_checkpoint(model: LlamaForCausalLM, out: Path, tokenizer_dir: Path, log: dict) -> None:
    """save_pretrained + tokenizer + train_log.json into a temporary folder, then swap it in."""
    out = out.resolve()
    tmp = out.with_name(f".{out.name}.tmp")
    old = out.with_name(f".{out.name}.old")
    for stale in (tmp, old):
        shutil.rmtree(stale, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy2(tokenizer_dir / name, tmp / name)
    (tmp / "train_log.json").write_text(json.dumps(log, indent=1) + "\n", encoding="utf-8")
    for f in tmp.iterdir():
        f.chmod(0o644)  # safetensors leaves its file owner-only
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--corpus", type=Path, default=Path("/work/demo_build/corpus"), help="train.txt + heldout.txt"
    )
    ap.add_argument("--tokenizer", type=Path, default=Path("/work/demo_build/tokenizer"))
    ap.add_argument("--out", type=Path, default=Path("/work/demo_build/hf"))
    ap.add_argument("--state", type=Path, default=None, help="training state file (default: beside --out)")
    ap.add_argument("--resume", action="store_true", help="continue from --state")
    ap.add_argument("--minutes", type=float, default=20.0, help="wall-clock budget; 0: none")
    ap.add_argument("--tokens", type=int, default=0, help="token budget (rows x 256); 0: none")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--warmup-steps", type=int, default=200)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--log-every", type=int, default=50, help="steps between train-loss lines")
    ap.add_argument("--eval-minutes", type=float, default=2.0, help="minutes between held-out evaluations")
    ap.add_argument("--eval-rows", type=int, default=48, help="held-out rows for periodic evaluation")
    ap.add_argument("--final-eval-rows", type=int, default=192, help="held-out rows for the final figures")
    ap.add_argument("--checkpoint-minutes", type=float, default=5.0)
    args = ap.parse_args(argv)
    if args.minutes <= 0 and args.tokens <= 0:
        ap.error("give a budget: --minutes and/or --tokens")
    if args.ffn <= 1000 or args.ffn % 256:
        ap.error(f"--ffn {args.ffn}: PowerInfer needs an FFN width above 1000 and a multiple of 256")
    if args.state is None:
        args.state = args.out.resolve().with_name("train_state.pt")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)

    sp = spm.SentencePieceProcessor(model_file=str(args.tokenizer / "tokenizer.model"))
    train = TextRows((args.corpus / "train.txt").read_text(encoding="utf-8"), sp, args.seq)
    heldout = TextRows((args.corpus / "heldout.txt").read_text(encoding="utf-8"), sp, args.seq)
    eval_rows = heldout.evenly_spaced(args.eval_rows)  # [N, S]

    config = model_config(args, sp.get_piece_size())
    model = LlamaForCausalLM(config)  # fp32 master weights
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        fused=False,
    )
    step, tokens, elapsed, history = 0, 0, 0.0, []
    if args.resume:
        state = torch.load(args.state, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step, tokens, elapsed, history = state["step"], state["tokens"], state["elapsed"], state["history"]
        torch.set_rng_state(state["torch_rng"])
        rng.bit_generator.state = state["numpy_rng"]
        print(
            f"resumed from {args.state}: step {step}, {tokens:,} tokens, {elapsed / 60:.1f} min", flush=True
        )

    print(
        f"model: {n_params:,} parameters, {config.num_hidden_layers} layers, FFN {config.intermediate_size}; "
        f"train {len(train.text):,} chars, held-out {len(heldout.text):,} chars; "
        f"budget {args.minutes} min / {args.tokens:,} tokens",
        flush=True,
    )
    budget_s = args.minutes * 60.0

    def progress() -> float:
        p = 0.0
        if budget_s > 0:
            p = max(p, elapsed / budget_s)
        if args.tokens > 0:
            p = max(p, tokens / args.tokens)
        return p

    start = time.perf_counter() - elapsed
    last_eval = last_ckpt = elapsed
    window_loss, window_tokens, window_t = 0.0, 0, elapsed
    model.train()
    while progress() < 1.0:
        lr = lr_at(step, progress(), args)
        for group in opt.param_groups:
            group["lr"] = lr
        x = train.sample(rng, args.batch)  # [B, S]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens += x.numel()
        window_loss += loss.item()
        window_tokens += x.numel()
        elapsed = time.perf_counter() - start

        if step % args.log_every == 0:
            rate = window_tokens / max(elapsed - window_t, 1e-9)
            print(
                f"step {step:6d}  tokens {tokens:10,}  {elapsed / 60:6.2f} min  lr {lr:.2e}  "
                f"train loss {window_loss / args.log_every:.4f}  {rate:,.0f} tok/s",
                flush=True,
            )
            history.append(
                {
                    "step": step,
                    "tokens": tokens,
                    "minutes": elapsed / 60,
                    "train_loss": window_loss / args.log_every,
                }
            )
            window_loss, window_tokens, window_t = 0.0, 0, elapsed
        if elapsed - last_eval >= args.eval_minutes * 60:
            h = heldout_loss(model, eval_rows, bf16=True)
            print(f"step {step:6d}  held-out loss {h:.4f}  perplexity {math.exp(h):.1f}", flush=True)
            history.append({"step": step, "tokens": tokens, "minutes": elapsed / 60, "heldout_loss": h})
            elapsed = time.perf_counter() - start
            last_eval = elapsed
        if elapsed - last_ckpt >= args.checkpoint_minutes * 60:
            save_state(
                args.state,
                {
                    "model": model.state_dict(),
                    "optimizer": opt.state_dict(),
                    "step": step,
                    "tokens": tokens,
                    "elapsed": elapsed,
                    "history": history,
                    "torch_rng": torch.get_rng_state(),
                    "numpy_rng": rng.bit_generator.state,
                    "args": {k: str(v) for k, v in vars(args).items()},
                },
            )
            elapsed = time.perf_counter() - start
            last_ckpt = elapsed

    print(
        f"training done: step {step}, {tokens:,} tokens, {elapsed / 60:.2f} min; final evaluation", flush=True
    )
    final_rows = heldout.evenly_spaced(args.final_eval_rows)
    t_eval = time.perf_counter()
    final_loss = heldout_loss(model, final_rows, bf16=False)
    sparsity = ffn_sparsity(model, final_rows)
    log = {
        "config": config.to_dict(),
        "parameters": n_params,
        "tokens_seen": tokens,
        "steps": step,
        "minutes": elapsed / 60,
        "tokens_per_second": tokens / max(elapsed, 1e-9),
        "heldout": {
            "rows": len(final_rows),
            "predicted_tokens": int(final_rows[:, 1:].numel()),
            "loss": final_loss,
            "perplexity": math.exp(final_loss),
            "dtype": "float32",
        },
        "ffn_sparsity": sparsity,
        "training": {k: v for k, v in vars(args).items() if not isinstance(v, Path)},
        "corpus": {
            "train_chars": len(train.text),
            "heldout_chars": len(heldout.text),
            "sources": "King James Version + World English Bible (public domain); see prepare_corpus.py",
        },
        "history": history,
    }
    print(
        f"held-out loss {final_loss:.4f}, perplexity {math.exp(final_loss):.2f} "
        f"({len(final_rows)} rows, fp32, {time.perf_counter() - t_eval:.0f} s)",
        flush=True,
    )
    for s in sparsity:
        print(
            f"layer {s['layer']}: FFN sparsity {s['sparsity']:.3f}, never fired {s['never_fired']}",
            flush=True,
        )
    save_checkpoint(model, args.out, args.tokenizer, log)
    print(f"saved {args.out}", flush=True)


if __name__ == "__main__":
    main()
