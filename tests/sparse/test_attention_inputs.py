"""sparse/attention_inputs.py: `hotcold sparsify --attention` files. The transposed matrices are the file's own
(checked with the gguf package), each product keeps exactly the input channels over its threshold (a float64
oracle from the file), sparsity 0 is dense bit for bit, and the one-call decode token, batches and thread
counts give the bits of the ops one by one."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

import hotcold
from hotcold.gguf import names
from hotcold.sparse.attention_inputs import OUT, QKV
from tests.sparse.test_thresholded import PROMPT


@pytest.fixture(scope="module")
def attn_files(tiny_swiglu, tmp_path_factory):
    """The tiny SwiGLU model sparsified at 0.5 with attention inputs: F16 with wina, Q8_0 with cats; "gate": F16
    with the gate from the input channels too (--gate-probe inputs); these three with --transpose-type same (F16
    transposes exact). "auto": F16 with both input rules and the default transposes (Q8_0 for a float source);
    "probe": F16 with the Q4_0 gate probe and the default copies (Q8_0 transposes, up and gate row copies)."""
    from hotcold.convert.sparsify import sparsify_file

    folder = tmp_path_factory.mktemp("attn_inputs")
    files = {}
    for name, outtype, method, probe, transposes in (
        ("f16", "f16", "wina", "none", "same"),
        ("q8_0", "q8_0", "cats", "none", "same"),
        ("gate", "f16", "wina", "inputs", "same"),
        ("auto", "f16", "wina", "inputs", "auto"),
        ("probe", "f16", "wina", "q4_0", "auto"),
    ):
        files[name] = folder / f"{name}.gguf"
        sparsify_file(
            tiny_swiglu.dense[outtype], files[name], tiny_swiglu.corpus, sparsity=0.5, max_tokens=tiny_swiglu.tokens,
            method=method, probe=probe, attention=True, transposes=transposes,
        )  # fmt: skip
    return files


def _floats(path):
    r = GGUFReader(path)

    def get(name):
        x = next(t for t in r.tensors if t.name == name)
        shape = tuple(int(s) for s in reversed(x.shape.tolist()))
        return torch.from_numpy(np.asarray(dequantize(x.data, x.tensor_type), dtype=np.float64)).reshape(
            shape
        )

    return get


def test_transposes_are_the_files_matrices(attn_files, tiny_swiglu):
    get, src = _floats(attn_files["f16"]), _floats(tiny_swiglu.dense["f16"])
    for i in range(2):
        qkv = torch.cat([src(f"blk.{i}.attn_{x}.weight") for x in "qkv"])
        assert torch.equal(get(names.tensor(names.ATTN_QKV_T, i)), qkv.T)  # F16: exact
        assert torch.equal(get(names.tensor(names.ATTN_OUT_T, i)), src(f"blk.{i}.attn_output.weight").T)
    get8, src8 = _floats(attn_files["q8_0"]), _floats(tiny_swiglu.dense["q8_0"])
    qkv8 = torch.cat([src8(f"blk.0.attn_{x}.weight") for x in "qkv"]).T
    err = (get8(names.tensor(names.ATTN_QKV_T, 0)) - qkv8).abs().max()
    assert 0 < err <= qkv8.abs().max() / 100  # re-quantized along the new rows: Q8_0's rounding


def test_default_transposes_of_a_float_file_are_ggufs_q8_0(attn_files, tiny_swiglu):
    """--transpose-type auto on an F16 file: every transposed copy is the gguf package's Q8_0 quantization of the
    source's matrices transposed (byte for byte), the originals stay untouched."""
    from gguf.quants import quantize

    r, src = GGUFReader(attn_files["auto"]), _floats(tiny_swiglu.dense["f16"])
    stored = {t.name: t for t in r.tensors}
    for i in range(2):
        for name, parts in (
            (names.ATTN_QKV_T, [f"blk.{i}.attn_{x}.weight" for x in "qkv"]),
            (names.ATTN_OUT_T, [f"blk.{i}.attn_output.weight"]),
            (names.FFN_GATE_T, [f"blk.{i}.ffn_gate.weight"]),
            (names.FFN_DOWN_T, [f"blk.{i}.ffn_down.weight"]),
        ):
            t = stored[names.tensor(name, i)]
            want = quantize(
                torch.cat([src(p) for p in parts]).T.float().contiguous().numpy(), GGMLQuantizationType.Q8_0
            )
            assert t.tensor_type == GGMLQuantizationType.Q8_0, t.name
            assert np.array_equal(np.asarray(t.data).reshape(-1), want.reshape(-1)), t.name
        assert stored[f"blk.{i}.ffn_gate.weight"].tensor_type == GGMLQuantizationType.F16


@pytest.mark.parametrize("name", ["auto", "probe"])
def test_decode_gathers_read_the_row_copies(attn_files, tiny_swiglu, name):
    """Default copies on an F16 file: ffn_up_rows (and with a probe ffn_gate_rows) are the gguf package's Q8_0 of
    the file's up and gate; one decode token's FFN equals a float64 oracle over those copies (the kept neurons'
    gate and up rows from them, times the token quantized to Q8_0 as ggml's integer dot does), while the file's
    own matrices are packed for the dense products."""
    from gguf.quants import quantize

    get, src = _floats(attn_files[name]), _floats(tiny_swiglu.dense["f16"])
    stored = {t.name: t for t in GGUFReader(attn_files[name]).tensors}
    llm = hotcold.load(attn_files[name], threads=1)
    torch.manual_seed(7)
    for i, layer in enumerate(llm.loaded.model.layers):
        ffn = layer.ffn
        copies = [("up", names.FFN_UP_ROWS, ffn.up_rows, ffn.weights.up)]
        if name == "probe":
            copies.append(("gate", names.FFN_GATE_ROWS, ffn.gate_rows, ffn.weights.gate))
        else:
            assert names.tensor(names.FFN_GATE_ROWS, i) not in stored  # no probe: the gate is never gathered
        for what, copy, rows, original in copies:
            t = stored[names.tensor(copy, i)]
            want = quantize(src(f"blk.{i}.ffn_{what}.weight").float().numpy(), GGMLQuantizationType.Q8_0)
            assert t.tensor_type == GGMLQuantizationType.Q8_0
            assert np.array_equal(np.asarray(t.data).reshape(-1), want.reshape(-1)), t.name
            assert rows is not original and original.packed is not None
        h = torch.randn(1, src(f"blk.{i}.ffn_up.weight").shape[1])
        seq_ctx = _ctx()
        out = ffn.apply(h, h, seq_ctx)
        mask = seq_ctx.recorded
        assert 0 < mask.float().mean() < 1
        # a Q8_0 row gather multiplies by the token quantized to int8 in chunks of 32 (_cpu_kernels.c, "Integer
        # dot products": scale amax / 127 kept in float32, round to nearest even)
        chunks = h.reshape(-1, 32)
        amax = chunks.abs().amax(dim=1, keepdim=True)
        hq = (torch.round(chunks * (127.0 / amax)).double() * (amax / 127.0).double()).reshape(h.shape)
        up = hq @ get(names.tensor(names.FFN_UP_ROWS, i)).T
        if name == "probe":
            gate = hq @ get(names.tensor(names.FFN_GATE_ROWS, i)).T
        else:
            g = ffn.gate_in
            keep_in = h.double().abs() * g.scale.double() > g.threshold
            gate = torch.where(keep_in, h.double(), 0.0) @ get(names.tensor(names.FFN_GATE_T, i))
        a = torch.where(mask, torch.nn.functional.silu(gate) * up, 0.0)
        want = a @ get(names.tensor(names.FFN_DOWN_T, i))
        err = float((out.double() - want).abs().max() / want.abs().max())
        assert err < 1e-5, (i, err)


def test_input_thresholds_are_the_quantiles_transformers_finds(attn_files, tiny_swiglu):
    """The 0.5-quantiles of |input| x the column norms (wina) of q/k/v's, o's and the gate's inputs in the fp32
    transformers model on the calibration windows, against the file's tables (F16 weights: within 1%)."""
    from tests.convert.test_sparsify import _calibration_windows

    llm = hotcold.load(tiny_swiglu.dense["f16"], threads=1)
    windows = _calibration_windows(llm, tiny_swiglu)
    hf = tiny_swiglu.hf
    seen = {}
    hooks = []
    for j, layer in enumerate(hf.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        qkv_norms = (
            torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).pow(2).sum(0).sqrt()
        )
        for key, mod, norms in (
            ((j, 0), attn.q_proj, qkv_norms),
            ((j, 1), attn.o_proj, attn.o_proj.weight.pow(2).sum(0).sqrt()),
            ((j, 2), mlp.gate_proj, mlp.gate_proj.weight.pow(2).sum(0).sqrt()),
        ):
            hook = mod.register_forward_pre_hook(
                lambda m, a, key=key, n=norms: seen.setdefault(key, []).append((a[0].abs() * n).flatten())
            )
            hooks.append(hook)
    with torch.no_grad():
        for w in windows:
            hf(input_ids=torch.tensor([w]))
    for h in hooks:
        h.remove()
    layers = hotcold.load(attn_files["gate"], threads=1).loaded.model.layers
    for j, layer in enumerate(layers):
        got = (*layer.inputs.thresholds, layer.ffn.gate_in.threshold)
        for which in range(3):
            want = float(torch.cat(seen[(j, which)]).double().quantile(0.5))
            assert abs(got[which] - want) < 0.01 * want, (j, which, got[which], want)


@pytest.mark.parametrize("outtype", ["f16", "q8_0", "auto"])
@pytest.mark.parametrize("n_tokens", [1, 9, 120])  # one-token axpy, batch axpy, masked GEMM
def test_products_keep_exactly_the_channels_over_the_threshold(attn_files, outtype, n_tokens):
    """The row kernels (under cpu.GEMM_MIN_TOKENS rows) read the transposed copies, the masked GEMM the
    layer's own matrices: the oracle takes the same ones."""
    from hotcold.kernels import cpu

    llm = hotcold.load(attn_files[outtype], threads=1)
    get = _floats(attn_files[outtype])
    originals = n_tokens >= cpu.GEMM_MIN_TOKENS
    torch.manual_seed(n_tokens)
    for i, layer in enumerate(llm.loaded.model.layers):
        inputs = layer.inputs
        assert inputs is not None and inputs.rows
        for which in (QKV, OUT):
            if not originals:
                w_t = get(names.tensor(names.ATTN_QKV_T if which == QKV else names.ATTN_OUT_T, i))
            elif which == QKV:
                w_t = torch.cat([get(f"blk.{i}.attn_{x}.weight") for x in "qkv"]).T
            else:
                w_t = get(f"blk.{i}.attn_output.weight").T
            din = w_t.shape[0]
            h = torch.randn(n_tokens, din) * 0.5
            mask = inputs.mask(h, which)
            score = h.double().abs()
            if inputs.scales[which] is not None:
                score = score * inputs.scales[which].double()
            clear = (score - inputs.thresholds[which]).abs() > 1e-6
            assert torch.equal(mask[clear], (score > inputs.thresholds[which])[clear])
            assert 0 < mask.float().mean() < 1
            want = torch.where(mask, h.double(), 0.0) @ w_t
            if which == QKV:
                got = torch.cat(inputs.qkv(h, _identity(), layer.qkv, None), dim=-1)
            else:
                got = inputs.o(h, layer.wo, None)
            tol = 3e-2 if outtype == "q8_0" and originals else 1e-4  # a Q8_0 GEMM quantizes the activations
            assert torch.allclose(got.double(), want, atol=tol * float(want.abs().max()), rtol=0), (i, which)


class _identity:
    def __call__(self, x):
        return x


@pytest.mark.parametrize("name", ["f16", "gate", "auto", "probe"])
def test_sparsity_zero_is_dense_bit_for_bit(attn_files, tiny_swiglu, name):
    dense = hotcold.load(tiny_swiglu.dense["f16"], threads=1)
    ids = dense.tokenize(PROMPT)
    llm = hotcold.load(attn_files[name], threads=1, sparsity=0)
    assert torch.equal(llm.logits(ids), dense.logits(ids))


@pytest.mark.parametrize("n_tokens", [1, 9, 120])  # one-token axpy (the C step), batch axpy, masked GEMM
def test_gate_from_the_kept_input_channels(attn_files, tiny_swiglu, n_tokens):
    """--gate-probe inputs: the kept neurons are those whose |silu(gate of the kept channels)| * scale is over
    the threshold, and their activation is that gate's, against a float64 oracle from the files."""
    llm = hotcold.load(attn_files["gate"], threads=1)
    get, src = _floats(attn_files["gate"]), _floats(tiny_swiglu.dense["f16"])
    torch.manual_seed(n_tokens)
    for i, layer in enumerate(llm.loaded.model.layers):
        ffn, g = layer.ffn, layer.ffn.gate_in
        assert g is not None and ffn.probe is None
        gate_t = get(names.tensor(names.FFN_GATE_T, i))
        assert torch.equal(gate_t, src(f"blk.{i}.ffn_gate.weight").T)
        h = torch.randn(n_tokens, gate_t.shape[0])
        keep_in = h.double().abs() * g.scale.double() > g.threshold
        gate = torch.where(keep_in, h.double(), 0.0) @ gate_t
        act = torch.nn.functional.silu(gate)
        score = act.abs() * ffn.scale.double()
        up = h.double() @ src(f"blk.{i}.ffn_up.weight").T
        seq_ctx = _ctx()
        out = ffn.apply(h, h, seq_ctx)
        mask = seq_ctx.recorded
        clear = (score - ffn.threshold).abs() > 1e-5
        assert torch.equal(mask[clear], (score > ffn.threshold)[clear]), i
        assert 0 < mask.float().mean() < 1
        want = torch.where(mask, act * up, 0.0) @ src(f"blk.{i}.ffn_down.weight").T
        assert torch.allclose(out.double(), want, atol=1e-3 * float(want.abs().max()), rtol=0), i


def test_attention_inputs_change_the_output_and_follow_the_sparsity(attn_files, tiny_swiglu):
    ffn_only = hotcold.load(tiny_swiglu.sparse["f16"], threads=1, sparsity=0.5)
    both = hotcold.load(attn_files["f16"], threads=1, sparsity=0.5)
    ids = both.tokenize(PROMPT)
    assert not torch.equal(both.logits(ids), ffn_only.logits(ids))
    shares = []
    for s in (0.3, 0.6):
        layer = hotcold.load(attn_files["f16"], threads=1, sparsity=s).loaded.model.layers[0]
        h = layer.attn_norm(torch.randn(64, layer.inputs.qkv_t.shape[0]))
        shares.append(float(layer.inputs.mask(h, QKV).float().mean()))
    assert shares[0] > shares[1]


@pytest.mark.parametrize("outtype", ["f16", "q8_0", "gate", "auto", "probe"])
def test_one_call_decode_batches_and_threads_give_the_ops_bits(attn_files, monkeypatch, outtype):
    from hotcold.runtime.cpu_step import CPUDecoder

    path = attn_files[outtype]
    prompts = [PROMPT, "The quick brown fox", "Line 12: 84 jumps over"]

    def run(threads=1):
        llm = hotcold.load(path, threads=threads, sparsity=0.5)
        alone = [llm.generate(p, max_tokens=8, ignore_eos=True) for p in prompts]
        return llm, alone, llm.logits(llm.tokenize(PROMPT))

    used = []
    real = CPUDecoder.__call__
    monkeypatch.setattr(
        CPUDecoder, "__call__", lambda self, x, ctx: used.append(got := real(self, x, ctx)) or got
    )
    llm, whole, logits = run()
    assert used and all(u is not None for u in used)  # every decode token in one C call
    assert llm.generate_batch(prompts, max_tokens=8, ignore_eos=True) == whole
    assert torch.equal(run(threads=2)[2], logits)
    monkeypatch.setattr(CPUDecoder, "__call__", lambda self, x, ctx: None)
    _, ops, ops_logits = run()
    assert ops == whole and torch.equal(ops_logits, logits)


class _ctx:
    """The parts of a Batch an FFN step reads: not dense, not observed; records the step's mask."""

    dense, observe, keep_masks, recorded = False, None, False, None

    def count(self, layer, mask, fired):
        self.recorded = mask


@pytest.mark.parametrize("name", ["gate", "ffn"])
def test_prompt_chunks_beside_decode_rows_give_each_alone(attn_files, tiny_swiglu, monkeypatch, name):
    """A prompt chunk of PROMPT_DENSE_ROWS rows or more runs the dense products, the decode rows of the same
    forward the row kernels: every generation's tokens equal its own run alone (the rule follows the chunk)."""
    from hotcold.runtime import batching
    from hotcold.runtime.engine import Engine
    from hotcold.runtime.generation import Generation
    from hotcold.sparse import thresholded

    path = attn_files["gate"] if name == "gate" else tiny_swiglu.sparse["f16"]
    llm = hotcold.load(path, threads=2, sparsity=0.5)
    model = llm.loaded.model
    prompts = ["In the beginning God", "The quick brown fox jumps over", "Line 12: 84 jumps over 3"]
    ids = [llm.tokenize(p) for p in prompts]
    assert all(len(i) >= thresholded.PROMPT_DENSE_ROWS for i in ids)
    gens = [Generation(Engine(model, llm.tokenizer, 256), p, max_tokens=10, ignore_eos=True) for p in ids]
    shapes, forward = [], model.forward
    monkeypatch.setattr(
        model, "forward", lambda t, ctx, **k: shapes.append(list(ctx.lengths)) or forward(t, ctx, **k)
    )
    texts = [""] * len(gens)
    for step in range(40):
        live = gens[: 1 + step // 2]  # the later prompts arrive while the first ones decode
        if all(g.done for g in gens):
            break
        batching.step(model, live)
        for i, g in enumerate(gens):
            texts[i] += "".join(c.text for c in g.drain())
    assert any(1 in s and max(s) >= thresholded.PROMPT_DENSE_ROWS for s in shapes)  # a mixed forward ran
    monkeypatch.setattr(model, "forward", forward)
    assert texts == [llm.generate(p, max_tokens=10, ignore_eos=True) for p in prompts]


@pytest.mark.parametrize("name", ["gate", "ffn", "probe"])
def test_mixed_forward_rows_have_their_own_bits(attn_files, tiny_swiglu, name):
    """One forward of a decode row (sequence A) and a 6-row prompt chunk (sequence B): each row's logits equal
    bit for bit those of its own forward alone, so neither rule depends on the other rows."""
    import torch

    from hotcold.runtime.state import Batch

    path = attn_files[name] if name != "ffn" else tiny_swiglu.sparse["f16"]
    model = hotcold.load(path, threads=2, sparsity=0.5).loaded.model
    prompt_a, chunk_b = [1, 45, 99, 7, 12, 300], [1, 8, 250, 31, 77, 5]

    def prefilled():
        seq = model.new_sequence(64)
        model.forward(torch.tensor(prompt_a), Batch.single(seq, 0, len(prompt_a)))
        return seq

    a_alone, a_mixed = prefilled(), prefilled()
    want_a = model.forward(torch.tensor([42]), Batch.single(a_alone, len(prompt_a), 1))
    want_b = model.forward(torch.tensor(chunk_b), Batch.single(model.new_sequence(64), 0, len(chunk_b)))
    mixed = Batch([a_mixed, model.new_sequence(64)], [len(prompt_a), 0], [1, len(chunk_b)])
    got = model.forward(torch.tensor([42, *chunk_b]), mixed)
    assert torch.equal(got[:1], want_a) and torch.equal(got[1:], want_b)


@pytest.mark.parametrize("dropped", ["blk.1.attn_qkv_t.weight", names.SPARSIFY_ATTN_SCALE_O])
def test_a_damaged_file_is_refused_naming_what_is_missing(attn_files, tmp_path, dropped):
    from hotcold.gguf.io import GGUFError, ModelFile, TensorSpec, metadata_items, write_model_file

    mf = ModelFile(attn_files["f16"])
    specs = [
        TensorSpec(e.name, e.shape, e.qtype, lambda e=e: e.data)
        for e in mf.tensors.values()
        if e.name != dropped
    ]
    bad = tmp_path / "damaged.gguf"
    write_model_file(bad, mf.architecture, metadata_items(mf), specs, sparse=False)
    with pytest.raises(GGUFError, match=dropped.replace(".", r"\.")):
        hotcold.load(bad, threads=1)
