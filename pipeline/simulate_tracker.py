"""Live-byte accounting of a training step, the way the CUDA caching allocator counts it.

`LiveBytesTracker` is a TorchDispatchMode: every storage that an op creates on the tracked device
is counted (rounded up like `torch.cuda.max_memory_allocated` counts blocks) until its last
reference goes (a weakref callback on the storage, as in torch.distributed._tools.MemTracker).
It keeps the running peak, per phase, with the bytes split by role at the peak moment. Kernels
that allocate scratch space inside one op (invisible on the meta device) add it through
`workspace_rules`: {aten overload: fn(args, kwargs, out) -> [bytes, ...]}; ops that the meta device
cannot run (data-dependent values) get `stand_ins`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from functools import partial

CATEGORIES = ("parameters", "gradients", "optimizer_state", "optimizer_intermediates", "activations")
SMALLEST_BLOCK = 512  # the CUDA caching allocator's kMinBlockSize: every block is a multiple of it


def allocated_bytes(nbytes: int) -> int:
    """Bytes one allocation adds to `torch.cuda.memory_allocated` (0 bytes allocate nothing)."""
    if nbytes <= 0:
        return 0
    return -(-nbytes // SMALLEST_BLOCK) * SMALLEST_BLOCK


@dataclass
class Snapshot:
    """Live bytes at one moment: the total, split by role, and the allocation count then."""

    total: int = 0
    parts: dict = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    seq: int = -1


def _host_scalar_ops() -> frozenset:
    """Ops that make 0-dim tensors from Python numbers: on CUDA they stay on the host (AdamW's
    `step` counters, masks' fill values), so a real CPU run must not count them either."""
    import torch

    aten = torch.ops.aten
    return frozenset({aten.lift_fresh.default, aten.scalar_tensor.default})


class MetaOutputCache:
    """Outputs of functional ops on meta tensors, remembered by the inputs' metadata.

    A transformer repeats the same ops layer after layer, and the meta kernels (Python reference
    implementations) are slow; an op that writes no input and returns no alias of one can be
    answered with fresh empty tensors of the remembered shapes, strides and dtypes.
    """

    LIMIT = 200_000  # entries; the cache starts over beyond it

    def __init__(self):
        self.functional = {}
        self.outputs = {}

    def run(self, func, args, kwargs):
        if not self._is_functional(func):
            return func(*args, **kwargs)
        try:
            key = (func, _describe(args), _describe(kwargs))
            hash(key)
        except TypeError:
            return func(*args, **kwargs)
        recipe = self.outputs.get(key)
        if recipe:
            return _rebuild(recipe)
        out = func(*args, **kwargs)
        if recipe is None:
            if _aliases_an_input(out, args):  # e.g. _unsafe_view: a view that its schema does not declare
                self.functional[func] = False
                return out
            if len(self.outputs) > self.LIMIT:
                self.outputs.clear()
            self.outputs[key] = _recipe(out)
        return out

    def _is_functional(self, func) -> bool:
        known = self.functional.get(func)
        if known is None:
            schema = func._schema
            known = self.functional[func] = func.namespace == "aten" and not schema.is_mutable and all(
                r.alias_info is None for r in schema.returns)
        return known


SHARED_OUTPUT_CACHE = MetaOutputCache()


def _aliases_an_input(out, args) -> bool:
    import torch

    def storages(values):
        for value in values:
            if isinstance(value, torch.Tensor):
                yield id(value.untyped_storage())
            elif isinstance(value, (list, tuple)):
                yield from storages(value)

    inputs = set(storages(args))
    return any(s in inputs for s in storages(out if isinstance(out, (list, tuple)) else (out,)))


def _describe(value):
    import torch

    if isinstance(value, torch.Tensor):
        if value.device.type != "meta":
            raise TypeError("only meta tensors are described")
        return ("T", tuple(value.shape), value.stride(), value.dtype, value.storage_offset())
    if isinstance(value, (list, tuple)):
        return tuple(_describe(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _describe(v)) for k, v in value.items())
    if value is None or isinstance(value, (int, float, str, torch.dtype, torch.device, torch.layout,
                                           torch.memory_format)):
        return value
    raise TypeError(f"{type(value).__name__} is not described")


def _recipe(out):
    """How to remake `out` (False when it cannot be remade faithfully: offsets, shared storages)."""
    import torch

    items = out if isinstance(out, (tuple, list)) else (out,)
    storages = set()
    recipe = []
    for t in items:
        if isinstance(t, torch.Tensor):
            twin = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
            if (t.device.type != "meta" or t.storage_offset() != 0 or id(t.untyped_storage()) in storages
                    or twin.untyped_storage().nbytes() != t.untyped_storage().nbytes()):
                return False
            storages.add(id(t.untyped_storage()))
            recipe.append(("T", tuple(t.shape), t.stride(), t.dtype))
        else:
            recipe.append(("V", t))
    return (list if isinstance(out, list) else tuple if isinstance(out, tuple) else None, recipe)


def _rebuild(recipe):
    import torch

    kind, items = recipe
    made = [torch.empty_strided(i[1], i[2], dtype=i[3], device="meta") if i[0] == "T" else i[1] for i in items]
    return made[0] if kind is None else kind(made)


def _tracker_class():
    from torch.utils._python_dispatch import TorchDispatchMode

    class LiveBytesTracker(TorchDispatchMode):
        def __init__(self, device_type: str, workspace_rules: dict | None = None, stand_ins: dict | None = None,
                     observer=None, allocator=None, host_outputs=None):
            super().__init__()
            self.observer = observer
            self.allocator = allocator
            self.host_outputs = host_outputs or {}
            self.device_type = device_type
            self.workspace_rules = workspace_rules or {}
            self.stand_ins = stand_ins or {}
            self.untracked_ops = _host_scalar_ops() if device_type == "cpu" else ()
            self.output_cache = SHARED_OUTPUT_CACHE if device_type == "meta" else None
            self.entries = {}  # id(storage) -> [weakref, bytes, category, seq]
            self.parts = dict.fromkeys(CATEGORIES, 0)
            self.live = 0
            self.seq = 0
            self.category = "activations"
            self.phase = None
            self.peaks = {}  # "total" and each phase name -> Snapshot

        # -- accounting -------------------------------------------------------------------------
        def track(self, tensor, category: str | None = None) -> None:
            """Count `tensor`'s storage from now until it is freed (no-op if already counted).

            Storages that exist before the step (weights) are allocated in the order given, as
            the model's build allocated them."""
            if tensor.device.type != self.device_type:
                return
            storage = tensor.untyped_storage()
            key = id(storage)
            entry = self.entries.get(key)
            if entry is not None:
                self._resized(entry, storage.nbytes())
                return
            address, size = self._malloc(storage.nbytes())
            category = category or self.category
            self.seq += 1
            ref = weakref.ref(storage, partial(self._freed, key))
            self.entries[key] = [ref, size, category, self.seq, address]
            self.parts[category] += size
            self.live += size

        def _malloc(self, nbytes: int):
            if self.allocator is None or nbytes <= 0:
                return None, allocated_bytes(nbytes)
            return self.allocator.malloc(nbytes)

        def _resized(self, entry, nbytes: int) -> None:
            """A storage that an op grew in place (`resize_`, `out=` arguments)."""
            if allocated_bytes(nbytes) <= entry[1]:
                return  # storages only grow; a grown one is a new block (the old one freed after the copy)
            address, size = self._malloc(nbytes)
            if entry[4] is not None:
                self.allocator.free(entry[4])
            self.parts[entry[2]] += size - entry[1]
            self.live += size - entry[1]
            entry[1], entry[4] = size, address

        def _freed(self, key, _ref) -> None:
            entry = self.entries.pop(key, None)
            if entry is not None:
                self.parts[entry[2]] -= entry[1]
                self.live -= entry[1]
                if entry[4] is not None:
                    self.allocator.free(entry[4])

        def retag(self, tensor, category: str) -> None:
            """Give a counted storage another role (a gradient, an optimizer moment).

            Peaks recorded after the storage was created had it under its old role; they are
            corrected too, since a storage alive now and created before a peak was alive then.
            """
            entry = self.entries.get(id(tensor.untyped_storage()))
            if entry is None or entry[2] == category:
                return
            size, old, seq = entry[1], entry[2], entry[3]
            for snap in self.peaks.values():
                if snap.seq >= seq:
                    snap.parts[old] -= size
                    snap.parts[category] += size
            self.parts[old] -= size
            self.parts[category] += size
            entry[2] = category

        def bytes_of(self, tensors) -> int:
            """Counted bytes of the distinct storages of `tensors`."""
            seen = {}
            for t in tensors:
                entry = self.entries.get(id(t.untyped_storage()))
                if entry is not None:
                    seen[id(entry)] = entry[1]
            return sum(seen.values())

        def note_peak(self, extra: int = 0) -> None:
            total = self.live + extra
            for name in ("total", self.phase):
                if name is None:
                    continue
                snap = self.peaks.get(name)
                if snap is None or total > snap.total:
                    parts = dict(self.parts)
                    parts["activations"] += extra
                    self.peaks[name] = Snapshot(total, parts, self.seq)

        def start_phase(self, phase: str, category: str) -> None:
            self.phase = phase
            self.category = category
            self.note_peak()

        # -- dispatch -----------------------------------------------------------------------------
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in self.stand_ins:
                out = self.stand_ins[func](func, args, kwargs)
            elif self.output_cache is not None:
                out = self.output_cache.run(func, args, kwargs)
            else:
                out = func(*args, **kwargs)
            if self.observer is not None:
                self.observer(func, args, kwargs, out)
            if func in self.untracked_ops:
                return out
            outputs = out if isinstance(out, (tuple, list)) else (out,)
            skip = self.host_outputs[func](args, kwargs) if func in self.host_outputs else ()
            for index, t in enumerate(outputs):
                if hasattr(t, "untyped_storage") and index not in skip:
                    self.track(t)
            rule = self.workspace_rules.get(func)
            extra = sum(allocated_bytes(n) for n in rule(args, kwargs, out)) if rule else 0
            self.note_peak(extra)
            return out

    return LiveBytesTracker


def make_tracker(device_type: str, workspace_rules: dict | None = None, stand_ins: dict | None = None,
                 observer=None, allocator=None, host_outputs: dict | None = None):
    """A LiveBytesTracker (the class needs torch, which is imported only here).

    `stand_ins` replaces ops ({aten overload: fn(func, args, kwargs) -> out}), e.g. to answer
    data-dependent questions (`.item()`) that the meta device cannot; `observer(func, args, kwargs,
    out)` sees every op; `allocator` (a simulate_allocator.CachingAllocator) counts blocks the way
    the CUDA caching allocator does instead of requests rounded to 512 bytes; `host_outputs`
    ({op: fn(args, kwargs) -> output indices}) names outputs that CUDA keeps on the host.
    """
    return _tracker_class()(device_type, workspace_rules, stand_ins, observer, allocator, host_outputs)
