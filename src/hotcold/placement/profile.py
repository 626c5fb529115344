"""Activation statistics: how often each FFN neuron fires on a corpus, counted on the dense path.

The counts feed the placement solver (hot neurons go to the GPU) and are written as PowerInfer's
`activation/activation_{i}.pt` files: one 1-D int64 tensor of length n_ff per layer.

The corpus helpers here (reading, tokenizing) are shared by `hotcold profile`, `hotcold train-predictors`
and `hotcold perplexity`; the first two also share the windows (BOS + CTX-1 corpus tokens), while
perplexity cuts llama.cpp's chunks (cli/perplexity.py).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch

from hotcold.atomic import atomic_directory, atomic_output, check_directory
from hotcold.placement.user_cache import cache_name, cache_root, writes_beside
from hotcold.runtime.state import Observer
from hotcold.validate import read_text_file

log = logging.getLogger(__name__)

DEFAULT_CTX = 512  # window length in tokens (llama.cpp's perplexity default), capped by the model's context


# ------------------------------------------------------------------------------------------------
# Corpus -> token windows
# ------------------------------------------------------------------------------------------------


def read_corpus(path: str | os.PathLike[str]) -> str:
    """The text of a corpus file; ValueError naming the file when it is missing, a folder, not UTF-8 (with
    the byte offset), or empty. `generate -f` reads its prompt file by the same rule."""
    path = Path(path)
    text = read_text_file(path, "the corpus, -f/--file")
    if not text.strip():
        raise ValueError(f"{path}: the corpus is empty (no text to run the model on)")
    return text


def corpus_tokens(
    tokenizer, text: str, *, max_tokens: int | None = None, spread: bool = False, source: str = "corpus"
) -> list[int]:
    """Token ids of `text` without BOS (control-token spellings in the text stay plain text, as llama.cpp's
    perplexity tool reads a corpus).

    With max_tokens only part of the text is tokenized: a prefix (cut at a line end), or with spread=True
    evenly spaced pieces of about SPREAD_BLOCK characters from the whole text, so that a sample of a long
    corpus that is sorted by source (book after book) still covers every source."""
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {max_tokens}")

    def encode(piece: str) -> list[int]:
        return tokenizer.encode(piece, add_bos=False, parse_special=False)

    if max_tokens is None:
        ids = encode(text)
    elif spread:
        ids = _spread_tokens(encode, text, max_tokens)
    else:
        chars = max_tokens * 6
        while True:
            cut = len(text) if chars >= len(text) else text.rfind("\n", 0, chars) + 1 or chars
            ids = encode(text[:cut])
            if len(ids) > max_tokens or cut >= len(text):
                break
            chars *= 2
        ids = ids[:max_tokens]
    if not ids:
        raise ValueError(f"{source}: the corpus has no tokens")
    return ids


SPREAD_BLOCK = 8192  # characters per sampled piece (cut at line ends)


def _line_blocks(text: str, size: int) -> list[str]:
    blocks, start = [], 0
    while start < len(text):
        end = text.find("\n", start + size)
        end = len(text) if end < 0 else end + 1
        blocks.append(text[start:end])
        start = end
    return blocks


def _spread_tokens(encode, text: str, max_tokens: int) -> list[int]:
    blocks = _line_blocks(text, SPREAD_BLOCK)
    cache: dict[int, list[int]] = {}

    def tokens_of(b: int) -> list[int]:
        if b not in cache:
            cache[b] = encode(blocks[b])
        return cache[b]

    chars_per_token = len(blocks[0]) / max(1, len(tokens_of(0)))
    k = math.ceil(1.05 * max_tokens * chars_per_token / SPREAD_BLOCK)
    while k < len(blocks):
        picks = sorted({round(j * (len(blocks) - 1) / max(1, k - 1)) for j in range(k)})
        ids = [t for b in picks for t in tokens_of(b)]
        if len(ids) >= max_tokens:
            return ids[:max_tokens]
        k = math.ceil(k * 1.2) + 1
    return encode(text)[:max_tokens]


def token_windows(ids: Sequence[int], ctx: int, bos_id: int | None) -> list[list[int]]:
    """Non-overlapping windows of at most ctx tokens covering every corpus token once: BOS (when the vocabulary
    has one) followed by the next ctx-1 corpus tokens. The last window may be shorter."""
    if ctx < 2:
        raise ValueError(f"the context size (-c/--ctx-size) must be >= 2 tokens, got {ctx}")
    head = [bos_id] if bos_id is not None else []
    step = ctx - len(head)
    return [head + list(ids[s : s + step]) for s in range(0, len(ids), step)]


def window_ctx(requested: int | None, n_ctx_train: int) -> int:
    """The window length: -c when given, else DEFAULT_CTX capped by the model's training context."""
    return requested if requested else min(DEFAULT_CTX, n_ctx_train)


# ------------------------------------------------------------------------------------------------
# Watching the dense FFNs
# ------------------------------------------------------------------------------------------------


def ffn_widths(llm) -> list[int]:
    """n_ff of every layer whose FFN the dense pass observes (MoE experts are not observed one by one)."""
    if llm.config.n_expert:
        raise ValueError(
            f"{llm.path}: observing the activations of mixture-of-experts layers is not supported"
        )
    layers = getattr(llm.loaded.model, "layers", None)
    if not layers:
        raise ValueError(f"{llm.path}: the model has no per-layer FFNs to observe")
    return [layer.ffn.n_ff for layer in layers]


def check_relu(llm) -> None:
    act = llm.config.ffn_activation
    if act != "relu":
        raise ValueError(
            f"{llm.path}: the FFN activation is {act!r}, not ReLU: neurons are never exactly zero, so there is "
            "no activation sparsity to measure (a dense llama GGUF without hotcold.ffn_activation='relu' is SiLU)"
        )


def run_windows(llm, windows: Sequence[list[int]], observe: Observer, *, desc: str, progress: bool) -> None:
    """One dense forward per window (every FFN neuron computed, `observe` sees every layer's true
    activations), with a progress bar in tokens. Works on a model loaded sparse or dense."""
    from tqdm import tqdm

    total = sum(len(w) for w in windows)
    with tqdm(total=total, desc=desc, unit="tok", disable=not progress) as bar:
        for window in windows:
            llm.engine.logits(window, observe=observe)
            bar.update(len(window))


# ------------------------------------------------------------------------------------------------
# Profiling
# ------------------------------------------------------------------------------------------------


def profile_routing(
    llm, ids: Sequence[int], *, ctx: int | None = None, progress: bool = False
) -> list[torch.Tensor]:
    """Per mixture-of-experts layer, how many of the corpus tokens the router sends to each expert: [n_expert]
    int64, written as the activation files are (one count per expert: what --ram-budget keeps resident, the
    most routed per byte). Windows as profile_activations'."""
    from tqdm import tqdm

    ctx = window_ctx(ctx, llm.config.n_ctx_train)
    if ctx > llm.ctx_size:
        raise ValueError(f"window of {ctx} tokens is longer than the model's context size {llm.ctx_size}")
    n_expert = llm.config.n_expert
    counts = [torch.zeros(n_expert, dtype=torch.int64) for _ in range(llm.config.n_layer)]

    def count(seq) -> None:
        for layer, routed in seq.routing.items():
            counts[layer] += torch.bincount(routed.flatten().cpu(), minlength=n_expert)

    windows = token_windows(ids, ctx, llm.tokenizer.bos_id)
    with tqdm(total=sum(len(w) for w in windows), desc="profiling", unit="tok", disable=not progress) as bar:
        for window in windows:
            llm.engine.logits(window, after_chunk=count)
            bar.update(len(window))
    return counts


def profile_activations(
    llm, ids: Sequence[int], *, ctx: int | None = None, progress: bool = False
) -> list[torch.Tensor]:
    """Per layer, how many of the corpus tokens make each FFN neuron's activation nonzero: [n_ff] int64; for a
    mixture of experts, how many the router sends to each expert (profile_routing).

    `llm` is a hotcold Model loaded with dense=True; `ids` the corpus tokens (see corpus_tokens), run in
    non-overlapping windows of ctx tokens that each start with BOS (BOS positions are counted too)."""
    if llm.config.n_expert:
        return profile_routing(llm, ids, ctx=ctx, progress=progress)
    check_relu(llm)
    widths = ffn_widths(llm)
    ctx = window_ctx(ctx, llm.config.n_ctx_train)
    if ctx > llm.ctx_size:
        raise ValueError(f"window of {ctx} tokens is longer than the model's context size {llm.ctx_size}")
    counts = [torch.zeros(n_ff, dtype=torch.int64) for n_ff in widths]

    def observe(layer: int, _x: torch.Tensor, _p: torch.Tensor, a: torch.Tensor) -> None:  # a: [T, F]
        counts[layer] += (a != 0).sum(0).cpu()

    windows = token_windows(ids, ctx, llm.tokenizer.bos_id)
    run_windows(llm, windows, observe, desc="profiling", progress=progress)
    n_tokens = sum(len(w) for w in windows)
    for i, c in enumerate(counts):
        log.info(
            "layer %d: %.1f%% of neurons fire per token", i, 100 * c.sum().item() / (n_tokens * c.numel())
        )
    return counts


def save_tensor(
    tensor: torch.Tensor | dict, path: Path, inputs: Iterable[str | os.PathLike[str]] = ()
) -> None:
    """torch.save through hotcold.atomic: never a half-written file, never over one of `inputs`. Through a
    Python file object: a full disk is then an OSError that atomic names, not torch's RuntimeError."""
    with atomic_output(path, inputs, what="output file") as tmp, open(tmp, "wb") as f:
        torch.save(tensor, f)


ACTIVATION_FILE = re.compile(r"activation_\d+\.pt")


def is_activation_file(name: str) -> bool:
    """An entry an activation folder may hold (the set `write_activation_files` replaces as a whole)."""
    return ACTIVATION_FILE.fullmatch(name) is not None


def check_activation_dir(
    out_dir: str | os.PathLike[str], inputs: Iterable[str | os.PathLike[str]] = ()
) -> Path:
    """Refuse, before a long run, a statistics folder that write_activation_files would refuse: one holding
    other files or an input, a file, the current folder (hotcold.atomic.check_directory)."""
    return check_directory(out_dir, inputs, owns=is_activation_file, what="statistics folder")


@contextlib.contextmanager
def activation_dir_writer(
    out_dir: str | os.PathLike[str], inputs: Iterable[str | os.PathLike[str]] = ()
) -> Iterator[Path]:
    """A temporary folder to fill with activation files, which then replaces `out_dir` as a whole
    (hotcold.atomic.atomic_directory): readers see the old set or the new one, never a mix."""
    with atomic_directory(out_dir, inputs, owns=is_activation_file, what="statistics folder") as staging:
        yield staging


def save_activation_files(counts: Sequence[torch.Tensor], folder: Path) -> list[str]:
    """activation_{i}.pt for every layer into `folder` (a staging folder of activation_dir_writer)."""
    names = [f"activation_{i}.pt" for i in range(len(counts))]
    for c, name in zip(counts, names, strict=True):
        save_tensor(c.clone(), folder / name)
    return names


def write_activation_files(
    counts: Sequence[torch.Tensor],
    out_dir: str | os.PathLike[str],
    inputs: Iterable[str | os.PathLike[str]] = (),
) -> list[Path]:
    """DIR/activation_{i}.pt for every layer, written as one set: the folder is replaced as a whole, so a
    failure partway leaves the old statistics as they were. None may be one of `inputs` (the model file, the
    corpus), nor may DIR hold an input or files that are not activation statistics."""
    out_dir = Path(out_dir)
    with activation_dir_writer(out_dir, inputs) as staging:
        names = save_activation_files(counts, staging)
    return [out_dir / name for name in names]


def read_activation_files(activation_dir: Path, n_layer: int, n_ff: int) -> list[torch.Tensor] | None:
    """DIR/activation_{i}.pt for every layer as stored (1-D counts of n_ff), or None when DIR is not a folder;
    a missing, torn, foreign or misshapen file is named (GGUFError), never a pickle traceback."""
    from hotcold.gguf.io import GGUFError

    if not activation_dir.is_dir():
        return None
    out = []
    for i in range(n_layer):
        file = activation_dir / f"activation_{i}.pt"
        if not file.exists():
            raise GGUFError(f"{activation_dir}: missing {file.name} (one file per layer, 0..{n_layer - 1})")
        try:
            counts = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as exc:  # a torn or foreign file: name it instead of a pickle traceback
            raise GGUFError(
                f"{file}: not a readable activation tensor ({type(exc).__name__}: {exc})"
            ) from exc
        if not isinstance(counts, torch.Tensor) or counts.dim() != 1 or counts.numel() != n_ff:
            raise GGUFError(f"{file}: expected a 1-D tensor of {n_ff} activation counts")
        out.append(counts)
    return out


def hottest_first(counts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Per layer, the neurons by activation count, hottest first; ties keep the file's order."""
    return [torch.argsort(c, descending=True, stable=True) for c in counts]


def activation_output_dir(model_path: str | os.PathLike[str]) -> Path:
    """Where `hotcold profile` writes a model's statistics without -o: `<model dir>/activation`, unless the model
    sits in the installed package (the bundled demo model) or a read-only folder, as for the placement cache
    (placement.gpuidx.writes_beside): then activation/<model name>.<digest of its path>/ in the user cache
    (HOTCOLD_CACHE_DIR, else ~/.cache/hotcold)."""
    if writes_beside(model_path):
        return Path(model_path).parent / "activation"
    return cache_root() / "activation" / cache_name(model_path)


def default_activation_dir(model_path: str | os.PathLike[str]) -> Path:
    """Where the loader and the placement look for a model's statistics: where `hotcold profile` writes them
    (activation_output_dir) when that folder exists, else `<model dir>/activation` (the bundled model's own,
    or PowerInfer's layout)."""
    written = activation_output_dir(model_path)
    return written if written.is_dir() else Path(model_path).parent / "activation"
