"""How to load a model, as one frozen record validated once: `hotcold.load`'s keywords, the CLI's model flags
and the server's, all go through `LoadOptions`, so every front end applies the same rules (NaN, infinities, out of
range: a ValueError naming the argument)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from hotcold import validate

DEVICES = ("auto", "cpu", "cuda")
DECODER_REQUESTS = ("auto", "eager")  # decoders.DECODERS: what load may choose


@dataclass(frozen=True)
class LoadOptions:
    """dense: compute every FFN neuron (ignore predictors). threads: CPU threads (None: the cores other processes
    leave free, cores.py). device: "auto", "cpu" or "cuda". vram_budget: GiB of VRAM (None: all free VRAM minus a
    margin; 0: CPU only). ctx_size: tokens a sequence's KV cache holds (None: the training context, capped).
    reset_gpu_index / disable_gpu_index: re-solve the hot-neuron placement / keep every FFN neuron on the CPU.
    n_gpu_layers: for dense files, offload the last N layers as llama.cpp's -ngl does. fast_device: where hot rows
    and offloaded layers go (None: the GPU when `device` resolves to cuda; tests pass "cpu" to stand in for it).
    sparsity: for a `hotcold sparsify` file, the share of FFN neurons to skip (None: the file's target; 0: dense).
    kv_sequences: KV caches held at once (a server's slots), each charged to a VRAM budget. decoder: "auto" (the
    fastest decoder the model's layers and devices allow, decoders.py) or "eager" (layer by layer). ram_budget: GiB of
    RAM for the model (None: no limit): what every token reads, then the hottest FFN neurons, stay in memory; the
    other neurons' rows are read from the file when selected (hotcold.storage). head_screen: make a Q8_0 screen of
    a float output head on the CPU, so greedy decode steps compute only the head rows that can win (head_screen.py;
    53% of the head's bytes more memory; off under a RAM budget)."""

    dense: bool = False
    threads: int | None = None
    device: str = "auto"
    vram_budget: float | None = None
    ctx_size: int | None = None
    reset_gpu_index: bool = False
    disable_gpu_index: bool = False
    n_gpu_layers: int | None = None
    fast_device: str | None = None
    sparsity: float | None = None
    kv_sequences: int = 1
    decoder: str = "auto"
    ram_budget: float | None = None
    head_screen: bool = True

    def __post_init__(self):
        for name in ("threads", "vram_budget", "n_gpu_layers", "ctx_size", "sparsity"):
            object.__setattr__(self, name, validate.check_optional(name, getattr(self, name)))
        # the VRAM budget's rule (a finite number >= 0), named as the RAM budget
        object.__setattr__(
            self, "ram_budget", validate.check_optional("vram_budget", self.ram_budget, label="ram_budget")
        )
        if self.device not in DEVICES:
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.decoder not in DECODER_REQUESTS:
            raise ValueError(f"decoder must be one of 'auto', 'eager', got {self.decoder!r}")
        if not isinstance(self.kv_sequences, int) or self.kv_sequences < 1:
            raise ValueError(f"kv_sequences must be >= 1, got {self.kv_sequences}")

    @classmethod
    def from_args(cls, args) -> LoadOptions:
        """The options of a CLI command's parsed model flags (cli.add_model_args); flags a command lacks keep
        their defaults. `serve -np N` holds a KV cache per slot plus the Model's own."""
        given = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        if hasattr(args, "parallel"):
            given["kv_sequences"] = args.parallel + 1
        return cls(**given)
