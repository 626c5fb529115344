"""The pure parts of benchmarks/perplexity_vs_llama.py (nothing here needs llama.cpp)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from benchmarks import perplexity_vs_llama as ppl
from hotcold.gguf.io import ModelFile
from tests.fixtures import tiny_gguf


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ppl")
    pwri = tiny_gguf(folder / "tiny.powerinfer.gguf", sparse=True)
    base = ppl.dense_copy(pwri, folder / "base.gguf")
    relu = ppl.retag(base, folder / "base.relu.gguf", activation="relu")
    st = ppl.to_smallthinker(base, folder / "base.st.gguf")
    return pwri, base, relu, st


def test_dense_copy_is_a_plain_gguf_of_the_same_weights(files):
    pwri, base, _, _ = files
    src, out = ModelFile(pwri), ModelFile(base)
    assert out.magic == "GGUF" and not out.is_sparse
    assert not [k for k in out.metadata if k.startswith("powerinfer.") or k.startswith("hotcold.")]
    assert not [n for n in out.tensors if ".fc1." in n or ".fc2." in n or "ffn_down_t" in n]
    for name, entry in src.tensors.items():
        if ppl.POWERINFER_ONLY.match(name):
            continue
        if "ffn_down_t" in name:
            down = out.tensors[name.replace("ffn_down_t", "ffn_down")]
            assert down.shape == entry.shape[::-1] and down.qtype == entry.qtype
            np.testing.assert_array_equal(np.asarray(down.data), np.asarray(entry.data).T)
        else:
            assert out.tensors[name].qtype == entry.qtype
            np.testing.assert_array_equal(np.asarray(out.tensors[name].data), np.asarray(entry.data))


def test_relu_tagged_copy_computes_what_the_powerinfer_file_computes_densely(files):
    import hotcold

    pwri, base, relu, _ = files
    ids = [1, 259, 262, 260, 265, 261, 5, 9]
    want = hotcold.load(pwri, dense=True, threads=1, device="cpu").logits(ids)
    got = hotcold.load(relu, dense=True, threads=1, device="cpu").logits(ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    silu = hotcold.load(base, dense=True, threads=1, device="cpu")
    assert silu.config.ffn_activation == "silu"  # what upstream's llama computes on the plain copy


def rope(x: np.ndarray, pos: int, pairs: list[tuple[int, int]]) -> np.ndarray:
    """Rotate (a, b) index pairs of one head's vector by angle pos * 10000^(-2i/Dh), i the pair's number."""
    out = x.copy()
    dh = len(x)
    for i, (a, b) in enumerate(pairs):
        t = pos * 10000.0 ** (-2 * i / dh)
        out[a] = x[a] * np.cos(t) - x[b] * np.sin(t)
        out[b] = x[a] * np.sin(t) + x[b] * np.cos(t)
    return out


def test_neox_rows_keep_attention_scores():
    h, dh = 3, 8
    order = ppl.neox_rows(h, dh)
    assert sorted(order) == list(range(h * dh))
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal(h * dh), rng.standard_normal(h * dh)
    norm = [(2 * i, 2 * i + 1) for i in range(dh // 2)]  # llama GGUF (ggml NORM)
    neox = [(i, i + dh // 2) for i in range(dh // 2)]  # ggml NEOX
    for head in range(h):
        s = slice(head * dh, (head + 1) * dh)
        want = rope(q[s], 5, norm) @ rope(k[s], 2, norm)
        got = rope(q[order][s], 5, neox) @ rope(k[order][s], 2, neox)
        assert got == pytest.approx(want, rel=1e-12)


def test_smallthinker_file_has_the_same_bytes_in_upstreams_layout(files):
    _, base, _, st = files
    src, out = ModelFile(base), ModelFile(st)
    assert out.architecture == "smallthinker"
    md = out.metadata
    assert md["smallthinker.expert_count"] == 1 and md["smallthinker.expert_used_count"] == 1
    assert md["smallthinker.expert_gating_func"] == 1
    assert md["smallthinker.expert_feed_forward_length"] == src.metadata["llama.feed_forward_length"]
    assert md["smallthinker.block_count"] == src.metadata["llama.block_count"]
    assert not [k for k in md if k.startswith("llama.")]
    order = ppl.neox_rows(src.metadata["llama.attention.head_count"], 8)
    np.testing.assert_array_equal(
        np.asarray(out.tensors["blk.0.attn_q.weight"].data),
        np.asarray(src.tensors["blk.0.attn_q.weight"].data)[order],
    )
    for kind in ("ffn_gate", "ffn_up", "ffn_down"):
        e, s = out.tensors[f"blk.1.{kind}_exps.weight"], src.tensors[f"blk.1.{kind}.weight"]
        assert e.shape == (1, *s.shape) and e.qtype == s.qtype
        np.testing.assert_array_equal(
            np.asarray(e.data).reshape(np.asarray(s.data).shape), np.asarray(s.data)
        )
    router = out.tensors["blk.0.ffn_gate_inp.weight"]
    assert router.shape == (1, src.metadata["llama.embedding_length"]) and not np.asarray(router.data).any()


def test_parse_llama_perplexity():
    text = (
        "perplexity: calculating perplexity over 181 chunks, n_ctx=256, batch_size=2048, n_seq=8\n"
        "[1]50.1,[2]51.2,\nFinal estimate: PPL = 55.0815 +/- 1.07128\n"
    )
    assert ppl.parse_llama_perplexity(text) == {
        "perplexity": 55.0815,
        "pm": 1.07128,
        "chunks": 181,
        "ctx": 256,
        "n_seq": 8,
    }
    with pytest.raises(RuntimeError, match="no final estimate"):
        ppl.parse_llama_perplexity("failed to load model\n")


def test_read_logits_file_round_trip(tmp_path):
    n_ctx, n_vocab, n_chunk = 8, 5, 2
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, n_vocab, n_chunk * n_ctx).astype(np.int32)
    n_scored, nv = n_ctx - 1 - n_ctx // 2, 2 * ((n_vocab + 1) // 2) + 4
    logits = rng.standard_normal((n_chunk, n_scored, n_vocab)).astype(np.float32)
    body = np.zeros((n_chunk, n_scored, nv), np.uint16)
    for c in range(n_chunk):  # llama-perplexity's log_softmax() encoding
        for r in range(n_scored):
            x = logits[c, r]
            lo = max(x.min(), x.max() - 16)
            lse = np.log(np.exp(x - x.max()).sum())
            scale = np.float32((x.max() - lo) / 65535)
            body[c, r, :4] = np.array([scale, lo - x.max() - lse], np.float32).view(np.uint16)
            body[c, r, 4 : 4 + n_vocab] = np.rint((x - lo) / scale)
    path = tmp_path / "logits.bin"
    path.write_bytes(
        b"_logits_"
        + np.array([n_ctx, n_vocab, n_chunk], np.int32).tobytes()
        + tokens.tobytes()
        + body.tobytes()
    )
    got_ctx, got_vocab, got_tokens, chunks = ppl.read_logits_file(path)
    assert (got_ctx, got_vocab) == (n_ctx, n_vocab)
    np.testing.assert_array_equal(got_tokens, tokens)
    for c, lp in enumerate(chunks):
        want = torch.log_softmax(torch.from_numpy(logits[c]).double(), -1).numpy()
        np.testing.assert_allclose(lp, want, atol=1e-3)
    assert c == n_chunk - 1


def test_work_folder_must_be_outside_the_repository():
    with pytest.raises(SystemExit):
        ppl.parse_args(["--work", str(ppl.REPO / "tmp"), "--text", "x.txt"])
