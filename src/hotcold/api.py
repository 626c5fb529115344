"""The Python API: `hotcold.load(...)` returns a Model with tokenize / logits / generate / stream / chat."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence

import torch

from hotcold.engine import Chunk, Engine
from hotcold.loader import LoadedModel, load_model
from hotcold.sampling import SamplingParams


class Model:
    """A loaded model with one generation context. Use one Model per thread."""

    def __init__(self, loaded: LoadedModel, load_seconds: float = 0.0):
        self.loaded = loaded
        self.config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.path = loaded.file.path
        self.load_seconds = load_seconds
        self.engine = Engine(loaded.model, loaded.tokenizer, loaded.ctx_size)
        self.last_stats = None

    @property
    def ctx_size(self) -> int:
        return self.engine.ctx_size

    def tokenize(self, text: str, *, add_bos: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_bos=add_bos)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    def logits(self, ids: Sequence[int]) -> torch.Tensor:
        return self.engine.logits(list(ids))

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        return self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)

    def stream_chunks(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        repeat_penalty: float = 1.0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        ignore_eos: bool = False,
    ) -> Iterator[Chunk]:
        params = SamplingParams(temperature, top_k, top_p, min_p, repeat_penalty, seed=seed)
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        for chunk in self.engine.stream(
            self._prompt_ids(prompt), max_tokens=max_tokens, params=params, stop=stops, ignore_eos=ignore_eos
        ):
            if chunk.finish_reason is not None:
                self.last_stats = chunk.stats
            yield chunk

    def stream(self, prompt: str | Sequence[int], **kwargs) -> Iterator[str]:
        for chunk in self.stream_chunks(prompt, **kwargs):
            if chunk.text:
                yield chunk.text

    def generate(self, prompt: str | Sequence[int], **kwargs) -> str:
        return "".join(self.stream(prompt, **kwargs))

    def chat(self, messages: Sequence[dict], **kwargs) -> str:
        return "".join(self.stream_chat(messages, **kwargs))

    def stream_chat(self, messages: Sequence[dict], **kwargs) -> Iterator[str]:
        return self.stream(self.chat_prompt_ids(messages), **kwargs)

    def chat_prompt_ids(self, messages: Sequence[dict]) -> list[int]:
        from hotcold.chat import render_chat

        # a template that writes the BOS text itself gets no second BOS from the tokenizer
        prompt = render_chat(self.tokenizer, messages)
        bos_id = self.tokenizer.bos_id
        ids = self.tokenizer.encode(prompt, add_bos=True, add_eos=False)  # the reply follows the prompt
        if bos_id is not None and len(ids) > 1 and ids[0] == bos_id and ids[1] == bos_id:
            ids = ids[1:]
        return ids


def load(
    path: str | os.PathLike[str] | None = None,
    *,
    vram_budget: float | None = None,
    threads: int | None = None,
    device: str = "auto",
    dense: bool = False,
    ctx_size: int | None = None,
    reset_gpu_index: bool = False,
    disable_gpu_index: bool = False,
    n_gpu_layers: int | None = None,
) -> Model:
    """Load a GGUF / PowerInfer model (None: the bundled demo model).

    vram_budget: GiB of GPU memory to use (None: all free VRAM minus a margin; 0: CPU only).
    n_gpu_layers: for dense files, offload the last N layers as llama.cpp's -ngl does."""
    start = time.perf_counter()
    loaded = load_model(
        path,
        dense=dense,
        threads=threads,
        device=device,
        vram_budget=vram_budget,
        ctx_size=ctx_size,
        reset_gpu_index=reset_gpu_index,
        disable_gpu_index=disable_gpu_index,
        n_gpu_layers=n_gpu_layers,
    )
    return Model(loaded, time.perf_counter() - start)
