"""A random transformers model of a real model's shape, converted to GGUF by `hotcold convert`: speed benchmarks for
the families synth.py (ReLU llama with predictors) does not write. Weights are random (transformers' init), the
tokenizer a small SentencePiece model trained on this checkout's README, padded to the shape's vocabulary as
llama.cpp pads; the file is the model's real size and layout, so decode reads the bytes the real one reads.

    python benchmarks/hf_shape.py --shape qwen3-0.6b -o /tmp/qwen3-0.6b.f16.gguf [--outtype f16]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

SHAPES = {
    # Qwen3-0.6B: 28 layers, width 1024, 16 query / 8 KV heads of 128, FFN 3072, tied 151,936 vocabulary
    "qwen3-0.6b": (
        "Qwen3",
        dict(
            vocab_size=151936,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=40960,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),  # fmt: skip
    # Qwen3-30B-A3B's layer (width 2048, 32 query / 4 KV heads of 128, 128 experts of 768, top-8 renormalised,
    # untied 151,936 vocabulary) in 4 layers instead of 48: the per-token expert bytes of the real model a layer
    "qwen3moe-30b-a3b-4l": (
        "Qwen3Moe",
        dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_hidden_layers=4,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            max_position_embeddings=40960,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),  # fmt: skip
}


def write_tokenizer(folder: Path) -> None:
    """tokenizer.model (SentencePiece BPE, byte fallback, llama's special ids) and tokenizer_config.json."""
    import sentencepiece as spm

    corpus = folder / "corpus.txt"
    corpus.write_text((Path(__file__).resolve().parents[1] / "README.md").read_text() * 4)
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(folder / "tokenizer"), vocab_size=512, model_type="bpe",
        byte_fallback=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, character_coverage=1.0, minloglevel=2,
    )  # fmt: skip
    corpus.unlink()
    (folder / "tokenizer.vocab").unlink(missing_ok=True)
    config = {"add_bos_token": True, "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--outtype", default="f16")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    import transformers

    from hotcold.convert import convert

    family, settings = SHAPES[args.shape]
    torch.manual_seed(args.seed)
    config = getattr(transformers, f"{family}Config")(**settings)
    model = getattr(transformers, f"{family}ForCausalLM")(config).to(torch.bfloat16).eval()
    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(tmp) / args.shape
        model.save_pretrained(hf, safe_serialization=True)
        del model
        write_tokenizer(hf)
        out = convert(hf, None, args.out, outtype=args.outtype, progress=True)
    print(json.dumps({"shape": args.shape, "file": str(out), "bytes": out.stat().st_size}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
