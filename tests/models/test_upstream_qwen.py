"""Qwen files as users download them: tiny Qwen2 / Qwen3 / Qwen3-MoE transformers models with Qwen's real byte-level
BPE vocabulary, converted by upstream llama.cpp's own converter (which identifies the vocabulary's pre-tokenizer
by hashing a test string's tokens: the rebuilt tokenizer hashes as Qwen2's, so the file says `qwen2`). hotcold
reads each and matches transformers' logits and tokens, and `hotcold convert` writes what upstream writes.

The vocabulary comes from upstream's `models/ggml-vocab-qwen2.gguf` (tokens and merges), rebuilt as the
`tokenizer.json` Qwen publishes (NFC, Qwen2's split regex, byte-level). Without the llama.cpp source the tests
skip, saying so."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import hotcold
from hotcold.gguf.io import ModelFile
from tests.fixtures import hf_logits, scale_matrices
from tests.models.test_upstream_files import SOURCE, upstream_convert

VOCAB = SOURCE / "models" / "ggml-vocab-qwen2.gguf"
pytestmark = pytest.mark.skipif(
    not VOCAB.is_file() or not (SOURCE / "convert_hf_to_gguf.py").is_file(),
    reason=f"no llama.cpp source at {SOURCE} (../shared/anchors/build-llama-cpp.sh unpacks it; HOTCOLD_LLAMA_CPP)",
)
QWEN2_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
N_VOCAB = 151936
TEXT = "Hello world! Qwen3 的 tokenizer: 3.14159, naïve café — <|im_start|>user\nhi<|im_end|>"


@pytest.fixture(scope="module")
def qwen_tokenizer(tmp_path_factory) -> Path:
    """A folder with Qwen2's tokenizer.json and tokenizer_config.json, rebuilt from upstream's vocab file."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    meta = ModelFile(VOCAB).metadata
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    vocab = {
        t: i for i, t in enumerate(tokens) if types[i] == 1
    }  # normal tokens; [PAD] fillers are not Qwen's
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i in range(len(tokens)) if types[i] == 3]
    )
    folder = tmp_path_factory.mktemp("qwen-tokenizer")
    tk.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
              "bos_token": None, "add_bos_token": False, "model_max_length": 32768}  # fmt: skip
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def make(kind: str, hf_dir: Path, tokenizer: Path):
    import transformers

    common = dict(vocab_size=N_VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=True,
                  bos_token_id=151643, eos_token_id=151643)  # fmt: skip
    if kind == "qwen2":
        hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(intermediate_size=256, **common))
    elif kind == "qwen3":
        hf = transformers.Qwen3ForCausalLM(
            transformers.Qwen3Config(intermediate_size=256, head_dim=32, **common)
        )
    else:
        config = transformers.Qwen3MoeConfig(intermediate_size=256, moe_intermediate_size=128, num_experts=4,
                                             num_experts_per_tok=2, norm_topk_prob=True, head_dim=32, **common)  # fmt: skip
        hf = transformers.Qwen3MoeForCausalLM(config)
    torch.manual_seed(0)
    hf = hf.eval()
    scale_matrices(hf)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "q_norm" in name or "k_norm" in name:
                p.add_(0.5 * torch.randn_like(p))
            if name.endswith("mlp.gate.weight"):  # a router that spreads tokens
                p.copy_(torch.randn_like(p))
    hf.save_pretrained(hf_dir, safe_serialization=True)
    for f in tokenizer.iterdir():
        shutil.copy(f, hf_dir / f.name)
    return hf


# Qwen2 (q/k/v biases) and Qwen3-MoE (Qwen3's attention with q/k norms, and the experts); Qwen3's dense file differs
# from the MoE one only in its FFN, which the SPM-vocabulary tests of tests/models/test_qwen.py cover (~1 min each)
@pytest.fixture(scope="module", params=["qwen2", "qwen3moe"])
def upstream_file(request, tmp_path_factory, qwen_tokenizer):
    folder = tmp_path_factory.mktemp(request.param)
    hf = make(request.param, folder / "hf", qwen_tokenizer)
    return request.param, hf, upstream_convert(folder / "hf", folder / "upstream.gguf")


def test_upstream_file_matches_transformers(upstream_file, qwen_tokenizer):
    from transformers import AutoTokenizer

    kind, hf, path = upstream_file
    mf = ModelFile(path)
    assert mf.architecture == kind and mf.metadata["tokenizer.ggml.pre"] == "qwen2"
    llm = hotcold.load(path, device="cpu")
    ids = AutoTokenizer.from_pretrained(qwen_tokenizer).encode(TEXT)
    assert llm.tokenize(TEXT, add_bos=False) == ids  # the file's vocabulary tokenizes as Qwen's own
    ours, ref = llm.logits(ids), hf_logits(hf, ids)
    assert ref.abs().max() > 1.0
    assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max(), float((ours - ref).abs().max())


def test_hotcold_convert_writes_what_upstream_writes(upstream_file, tmp_path):
    from hotcold.convert import convert

    kind, _, path = upstream_file
    theirs = ModelFile(path)
    ours = ModelFile(convert(Path(path).parent / "hf", None, tmp_path / "ours.gguf", outtype="f32"))
    assert sorted(ours.tensors) == sorted(theirs.tensors)
    for name in ours.tensors:
        a, b = ours.tensor(name).float(), theirs.tensor(name).float()
        assert a.shape == b.shape and bool((a == b).all()), name
    keys = {k for k in theirs.metadata if k.startswith(f"{kind}.") or k.startswith("tokenizer.ggml.")}
    keys -= {"tokenizer.ggml.add_bos_token"} if "tokenizer.ggml.add_bos_token" not in ours.metadata else set()
    assert {k: ours.metadata.get(k) for k in sorted(keys)} == {k: theirs.metadata[k] for k in sorted(keys)}
