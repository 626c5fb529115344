"""The Python API: `hotcold.load(...)` returns a Model with tokenize / logits / generate / stream / chat.

Structured output: `json_schema=` (a dict or JSON text), `grammar=` (GBNF or Lark text) or
`json_object=True` on generate / stream / chat / generate_batch constrain the output to it (see
hotcold.structured; ValueError for a bad schema or grammar)."""

from __future__ import annotations

import gc
import os
import threading
import time
import weakref
from collections.abc import Iterator, Sequence

import torch

from hotcold.load_options import LoadOptions
from hotcold.loader import LoadedModel, load_model
from hotcold.runtime import batching
from hotcold.runtime.engine import Chunk, Engine
from hotcold.runtime.generation import Generation
from hotcold.runtime.sampling import SamplingParams
from hotcold.structured import compile_constraint


class Model:
    """A loaded model and its own generation context (a KV cache with prefix reuse). Safe to share between
    threads: calls that use the context take their turn (one stream runs at a time; a second thread's
    call waits for it). For several generations at once use `generate_batch`, which runs them in one
    batch, or give each thread its own `Engine(llm.loaded.model, ...)`: the model itself is never
    written by a forward."""

    def __init__(self, loaded: LoadedModel, load_seconds: float = 0.0):
        self.loaded = loaded
        self.config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.path = loaded.file.path
        self.load_seconds = load_seconds
        self.engine = Engine(loaded.model, loaded.tokenizer, loaded.ctx_size)
        self.last_stats = None
        self._turn = threading.Lock()  # the engine's context: one user at a time
        # the thread holding the turn, by its Thread object: a thread id is reused once its thread has ended,
        # so a new thread would look like the owner; a weak reference, so an ended thread is not kept
        self._owner: weakref.ref[threading.Thread] | None = None

    def _take_turn(self):
        me = threading.current_thread()
        owner = self._owner
        if owner is not None and owner() is me:
            raise RuntimeError(
                "this thread is already generating with this Model (a stream not yet finished or closed): "
                "finish or close it first, or use generate_batch for several generations at once"
            )
        self._turn.acquire()
        self._owner = weakref.ref(me)

    def _end_turn(self):
        self._owner = None
        self._turn.release()

    @property
    def decoder(self) -> str:
        """ "eager", "cpu_one_call" or "cuda_graph": the decoder chosen at load ("eager" once a fast one failed)."""
        return self.loaded.decoder

    @property
    def ctx_size(self) -> int:
        return self.engine.ctx_size

    def tokenize(self, text: str, *, add_bos: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_bos=add_bos)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    def logits(self, ids: Sequence[int]) -> torch.Tensor:
        self._take_turn()
        try:
            return self.engine.logits(list(ids))
        finally:
            self._end_turn()

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
        json_schema: dict | str | None = None,
        grammar: str | None = None,
        json_object: bool = False,
    ) -> Iterator[Chunk]:
        params = SamplingParams(temperature, top_k, top_p, min_p, repeat_penalty, seed=seed)
        constraint = compile_constraint(json_schema=json_schema, grammar=grammar, json_object=json_object)
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        ids = self._prompt_ids(prompt)
        self._take_turn()
        try:
            for chunk in self.engine.stream(
                ids,
                max_tokens=max_tokens,
                params=params,
                stop=stops,
                ignore_eos=ignore_eos,
                constraint=constraint,
            ):
                if chunk.finish_reason is not None:
                    self.last_stats = chunk.stats
                yield chunk
        finally:
            self._end_turn()

    def stream(self, prompt: str | Sequence[int], **kwargs) -> Iterator[str]:
        for chunk in self.stream_chunks(prompt, **kwargs):
            if chunk.text:
                yield chunk.text

    def generate(self, prompt: str | Sequence[int], **kwargs) -> str:
        return "".join(self.stream(prompt, **kwargs))

    def generate_batch(
        self,
        prompts: Sequence[str | Sequence[int]],
        *,
        max_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        repeat_penalty: float = 1.0,
        seed: int | Sequence[int | None] | None = None,
        stop: str | Sequence[str] | None = None,
        ignore_eos: bool = False,
        json_schema: dict | str | Sequence[dict | str | None] | None = None,
        grammar: str | Sequence[str | None] | None = None,
    ) -> list[str]:
        """Generate for every prompt at once, one forward per step for all of them (continuous batching:
        finished ones leave, weights are read once per step). Each result equals `generate` of that prompt
        alone with the same arguments; `seed`, `json_schema` and `grammar` may be one per prompt (a list;
        None: that prompt is not constrained). Statistics of each generation are in `last_batch_stats`."""
        seeds = _per_prompt(seed, prompts, "seeds")
        schemas = _per_prompt(json_schema, prompts, "json_schema", dict)
        grammars = _per_prompt(grammar, prompts, "grammar", str)
        constraints = [compile_constraint(json_schema=j, grammar=g) for j, g in zip(schemas, grammars)]
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        engines = [Engine(self.loaded.model, self.tokenizer, self.ctx_size) for _ in prompts]
        gens = [
            Generation(
                e,
                self._prompt_ids(p),
                max_tokens=max_tokens,
                stop=stops,
                ignore_eos=ignore_eos,
                params=SamplingParams(temperature, top_k, top_p, min_p, repeat_penalty, seed=s),
                constraint=c,
            )
            for e, p, s, c in zip(engines, prompts, seeds, constraints)
        ]
        texts = ["".join(c.text for c in g.drain()) for g in gens]  # max_tokens=0 is done at once
        while any(not g.done for g in gens):
            batching.share_starts(gens)
            batching.step(self.loaded.model, gens)
            for i, g in enumerate(gens):
                texts[i] += "".join(c.text for c in g.drain())
        self.last_batch_stats = [g.stats for g in gens]
        return texts

    def chat(self, messages: Sequence[dict], **kwargs) -> str:
        return "".join(self.stream_chat(messages, **kwargs))

    def stream_chat(self, messages: Sequence[dict], **kwargs) -> Iterator[str]:
        return self.stream(self.chat_prompt_ids(messages), **kwargs)

    def chat_prompt_ids(self, messages: Sequence[dict], *, tools: Sequence[dict] | None = None) -> list[int]:
        """The prompt of a conversation (OpenAI messages; `tools`: function definitions, see hotcold.chat)."""
        from hotcold.chat import render_chat

        # a template that writes the BOS text itself gets no second BOS from the tokenizer
        own = f"{self.path.name}'s chat template (tokenizer.chat_template)"  # errors name the model's file
        prompt = render_chat(
            self.tokenizer, messages, tools=tools, template_name=own if self.tokenizer.chat_template else None
        )
        bos_id = self.tokenizer.bos_id
        ids = self.tokenizer.encode(prompt, add_bos=True, add_eos=False)  # the reply follows the prompt
        if bos_id is not None and len(ids) > 1 and ids[0] == bos_id and ids[1] == bos_id:
            ids = ids[1:]
        return ids


def _per_prompt(value, prompts: Sequence, name: str, single: type | tuple = ()) -> list:
    """`value` for every prompt, or one per prompt when it is a list (a dict or a str is one value)."""
    if isinstance(value, (list, tuple)) and not isinstance(value, single or ()):
        if len(value) != len(prompts):
            raise ValueError(f"{len(value)} {name} for {len(prompts)} prompts")
        return list(value)
    return [value] * len(prompts)


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
    sparsity: float | None = None,
    kv_sequences: int = 1,
    decoder: str = "auto",
    ram_budget: float | None = None,
    head_screen: bool = True,
) -> Model:
    """Load a GGUF / PowerInfer model (None: the bundled demo model).

    vram_budget: GiB of GPU memory to use (None: all free VRAM minus a margin; 0: CPU only).
    n_gpu_layers: for dense files, offload the last N layers as llama.cpp's -ngl does.
    sparsity: for a file written by `hotcold sparsify`, the share of FFN neurons (with --attention: and of
    the attention products' input channels) skipped per token, in [0, 1) (None: the file's own target; 0: dense).
    kv_sequences: KV caches the program will hold at once (the Model's own, plus one per server slot or
    thread engine), so a VRAM budget charges each of them; above 1, with activation statistics beside a
    sparse file, the CPU's FFN rows are kept hottest first for batches (`generate_batch`, loader.neuron_order).
    decoder: "auto" (the fastest the model's layers and devices allow: "cuda_graph" for a model all on one GPU,
    "cpu_one_call" for one the C decode layer computes on the CPU) or "eager" (layer by layer); `Model.decoder`
    says which runs.
    ram_budget: GiB of RAM for the model (None: no limit): what every token reads, then the hottest FFN neurons
    stay resident, the other neurons' rows are read from the file when the predictor selects them (same bits).
    head_screen: a Q8_0 screen of a float output head (53% of its bytes more memory) lets greedy decode steps
    compute only the head rows that can win (the same tokens; head_screen.py); off under a RAM budget."""
    options = LoadOptions(
        dense=dense, threads=threads, device=device, vram_budget=vram_budget, ctx_size=ctx_size,
        reset_gpu_index=reset_gpu_index, disable_gpu_index=disable_gpu_index, n_gpu_layers=n_gpu_layers,
        sparsity=sparsity, kv_sequences=kv_sequences, decoder=decoder, ram_budget=ram_budget,
        head_screen=head_screen,
    )  # fmt: skip
    return load_with(path, options)


def load_with(path: str | os.PathLike[str] | None, options: LoadOptions) -> Model:
    """`load` with its options already made (the CLI's model flags: LoadOptions.from_args)."""
    start = time.perf_counter()
    loaded = load_model(path, options)
    # The model's objects (layers, weights, one FFN per expert) live as long as it does: out of the collector's
    # scans, which otherwise walk them all every few hundred allocations of a decode (3-5% of a gpt-oss token).
    # They hold reference cycles, so once the Model is dropped they go back to the collector (gc.unfreeze).
    gc.freeze()
    model = Model(loaded, time.perf_counter() - start)
    weakref.finalize(model, gc.unfreeze)
    return model
