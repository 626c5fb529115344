"""Greedy continuations from the trained demo checkpoint, to check that its text is sensible.

Encodes with SentencePiece itself (BOS + prompt), generates with transformers, decodes with
SentencePiece.

Usage::

    python scripts/demo_model/sample.py --model /work/demo_build/hf -n 48 "In the beginning" "Once upon a time"
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import sentencepiece as spm
import torch
from transformers import LlamaForCausalLM

DEFAULT_PROMPTS = ["In the beginning", "And the LORD said", "Once upon a time", "Blessed are the"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("prompts", nargs="*", default=DEFAULT_PROMPTS)
    ap.add_argument("--model", type=Path, default=Path("/work/demo_build/hf"))
    ap.add_argument("-n", "--n-predict", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    sp = spm.SentencePieceProcessor(model_file=str(args.model / "tokenizer.model"))
    model = LlamaForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    for prompt in args.prompts:
        ids = torch.tensor([[sp.bos_id()] + sp.encode(prompt)])  # [1, S]
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                ids, max_new_tokens=args.n_predict, do_sample=False, eos_token_id=sp.eos_id(), pad_token_id=0
            )
        n_new = out.shape[1] - ids.shape[1]
        rate = n_new / (time.perf_counter() - t0)
        print(f"--- {prompt!r} ({n_new} tokens, {rate:.0f} tok/s)")
        # Decode prompt and continuation together: decoding the continuation alone would drop the
        # space that its first piece ("▁word") carries.
        print(sp.decode(out[0, 1:].tolist()))


if __name__ == "__main__":
    main()
