"""Count what a piece of GPU code would launch, and where it would make the host wait, without a GPU.

    with LaunchCounter("meta") as count:      # or "cuda" on a real GPU
        step(...)
    count.launches, count.syncs, count.by_op

Run the code on the `meta` device (tensors with shapes and dtypes, no data): every torch op goes through
the same dispatcher path as on CUDA, so a `TorchDispatchMode` sees each op that would run a kernel there.
Triton kernels do not pass through torch's dispatcher, so they are launched through `launch()` below,
which counts them and, on `meta` tensors, skips running them.

What counts:
- a launch: an op with a tensor on the counted device that runs a kernel (views and bare allocations do
  not), or a Triton kernel launched through `launch()`;
- a host sync: anything that makes the host wait for the device: reading a device value on the host
  (`.item()`, `bool(t)`, `.tolist()`), a blocking device-to-host copy, ops whose output size depends on the
  data (`nonzero`, boolean-mask indexing, `masked_select`, `unique`);
- `h2d` / `d2h`: host-to-device and device-to-host copies (a non-blocking one is not a sync by itself).

On `meta`, a sync's value does not exist: a device-to-host copy gives zeros and `.item()` gives 0, so
the code goes on and the counts stay right (the numbers computed after it do not matter here).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# ops that allocate or reinterpret memory without running a kernel
_NO_KERNEL = {
    aten.empty.memory_format,
    aten.empty_strided.default,
    aten.empty_like.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
    aten.detach.default,
    aten.lift_fresh.default,
    aten.alias.default,
    aten._unsafe_view.default,
    aten.set_.source_Storage_storage_offset,
    aten.resize_.default,
}
# ops whose output shape depends on the values: the host must wait for them
_DATA_DEPENDENT = {
    aten.nonzero.default,
    aten.masked_select.default,
    aten.is_nonzero.default,
    aten.equal.default,
    aten._unique2.default,
    aten.unique_consecutive.default,
    aten.unique_dim.default,
}

_ACTIVE: list[LaunchCounter] = []


def _tensors(tree) -> list[torch.Tensor]:
    out = []
    for item in tree:
        if isinstance(item, torch.Tensor):
            out.append(item)
        elif isinstance(item, (list, tuple)):
            out.extend(_tensors(item))
    return out


class LaunchCounter(TorchDispatchMode):
    """Counts kernel launches and host syncs on `device` ("cuda" or "meta") while active."""

    def __init__(self, device: str | torch.device = "meta"):
        super().__init__()
        self.device_type = torch.device(device).type
        self.launches = 0
        self.syncs = 0
        self.h2d = 0
        self.d2h = 0
        self.by_op: Counter[str] = Counter()
        self.sync_ops: Counter[str] = Counter()

    def __enter__(self):
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _ACTIVE.remove(self)
        return super().__exit__(*exc)

    def _on_device(self, tensors) -> bool:
        return any(t.device.type == self.device_type for t in tensors)

    def note_launch(self, name: str) -> None:
        self.launches += 1
        self.by_op[name] += 1

    def _sync(self, name: str) -> None:
        self.syncs += 1
        self.sync_ops[name] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.removeprefix("aten::")
        tensors = _tensors(args) + _tensors(kwargs.values())
        meta = self.device_type == "meta"
        if func in (aten._to_copy.default, aten.copy_.default):
            src = args[0] if func is aten._to_copy.default else args[1]
            dst_device = (
                torch.device(kwargs.get("device") or src.device)
                if func is aten._to_copy.default
                else args[0].device
            )
            if src.device.type == self.device_type and dst_device.type == "cpu":
                self.d2h += 1
                if not kwargs.get("non_blocking", False) and not (len(args) > 2 and args[2]):
                    self._sync(name)
                self.note_launch(name)
                if meta:  # the value does not exist: zeros of the right shape keep the code going
                    if func is aten._to_copy.default:
                        dtype = kwargs.get("dtype") or src.dtype
                        return torch.zeros(src.shape, dtype=dtype, device="cpu")
                    return args[0]
                return func(*args, **kwargs)
            if src.device.type == "cpu" and dst_device.type == self.device_type:
                self.h2d += 1
                self.note_launch(name)
                return func(*args, **kwargs)
        if not self._on_device(tensors):
            return func(*args, **kwargs)
        if func is aten._local_scalar_dense.default:
            self._sync(name)
            return 0 if meta else func(*args, **kwargs)
        if func in _DATA_DEPENDENT or (
            func is aten.index.Tensor and any(t.dtype == torch.bool for t in _tensors(args[1:]))
        ):
            self._sync(name)
            if meta:  # no data to size the output by: the op on zeros, as if nothing were selected
                self.note_launch(name)
                return _on_zeros(func, args, kwargs)
        if func not in _NO_KERNEL and not func.is_view:
            self.note_launch(name)
        return func(*args, **kwargs)


def _on_zeros(func, args, kwargs):
    """func over CPU zeros in place of the meta tensors, its tensors moved back to meta."""

    def zeros(item):
        if isinstance(item, torch.Tensor) and item.device.type == "meta":
            return torch.zeros(item.shape, dtype=item.dtype)
        if isinstance(item, (list, tuple)):
            return type(item)(zeros(i) for i in item)
        return item

    out = func(*zeros(args), **{k: zeros(v) for k, v in kwargs.items()})
    if isinstance(out, torch.Tensor):
        return out.to("meta")
    return (
        out
        if not isinstance(out, tuple)
        else tuple(o.to("meta") if isinstance(o, torch.Tensor) else o for o in out)
    )


def launch(kernel, grid, *args, **kwargs) -> None:
    """kernel[grid](*args, **kwargs), counted by every active LaunchCounter; on `meta` tensors the
    kernel is counted and not run (there is nothing to run it on)."""
    if not _ACTIVE:  # the decode loop's case: nothing counts, and meta tensors only come with a counter
        kernel[grid](*args, **kwargs)
        return
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    name = getattr(getattr(kernel, "fn", kernel), "__name__", "triton")
    for counter in _ACTIVE:
        if counter._on_device(tensors):
            counter.note_launch(f"triton:{name}")
    if any(t.device.type == "meta" for t in tensors):
        return
    kernel[grid](*args, **kwargs)


def host_wait(event) -> None:
    """The host waits for `event` (a torch.cuda.Event; None: nothing to wait for; "meta": a wait that
    would happen on a GPU), counted as one host sync by every active LaunchCounter."""
    if event is None:
        return
    for counter in _ACTIVE:
        counter._sync("event_wait")
    if not isinstance(event, str):
        event.synchronize()
