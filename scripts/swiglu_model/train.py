"""Train the SwiGLU LLaMA that `hotcold sparsify` is measured on: the demo model's recipe with SiLU.

The same corpus, tokenizer, shape and schedule as the bundled demo model (scripts/demo_model/, see its
README), only ``hidden_act="silu"``: an ordinary SwiGLU LLaMA, dense, as users' Llama / Qwen / Mistral
files are. Every flag of ``train_model.py`` applies (``--minutes``, ``--threads``, ``--tokens``, ...).

    python scripts/demo_model/prepare_corpus.py --out /work/swiglu_build/corpus
    python scripts/demo_model/train_tokenizer.py --corpus /work/swiglu_build/corpus/train.txt \\
        --out /work/swiglu_build/tokenizer
    python scripts/swiglu_model/train.py --corpus /work/swiglu_build/corpus \\
        --tokenizer /work/swiglu_build/tokenizer --out /work/swiglu_build/hf --minutes 12 --threads 1
    hotcold convert /work/swiglu_build/hf -o /work/swiglu_build/swiglu.f32.gguf --outtype f32 --dense

Training runs in fp32 (``--bf16`` for the demo script's bf16 autocast, which CPUs without bf16
instructions emulate slowly). (`train_log.json`'s "sparsity" figures count exact zeros of the activation: about 0 for SiLU.)
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "demo_model"))

import train_model  # noqa: E402  (scripts/demo_model/train_model.py)

_relu_config = train_model.model_config


def silu_config(args, vocab_size):
    config = _relu_config(args, vocab_size)
    config.hidden_act = "silu"
    return config


train_model.model_config = silu_config


class _NoAutocast:
    """fp32 training: bf16 autocast is emulated (slow) on CPUs without bf16 instructions, as this one."""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


if "--bf16" in sys.argv:
    sys.argv.remove("--bf16")
else:
    train_model.torch.autocast = _NoAutocast  # this script's own process only

if __name__ == "__main__":
    train_model.main()
