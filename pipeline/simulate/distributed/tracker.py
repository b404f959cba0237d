"""The live-byte tracker for a sharded step: DTensors, storages that FSDP2 resizes, and the roles of
the collectives' buffers.

`ShardedTracker` is the simulator's `LiveBytesTracker` with three additions, all needed because the
real torch code (FSDP2, DDP) runs underneath:

- A DTensor op is seen once, at the DTensor level (the local op runs with the mode off), so an
  output DTensor is counted by its local tensor's storage.
- FSDP2 frees and re-allocates the unsharded parameters by `UntypedStorage.resize_` (0 after the
  reshard, full size at the next all-gather), which no TorchDispatchMode sees; the tracker wraps
  `torch.UntypedStorage.resize_` while it is active, as torch.distributed._tools.MemTracker does.
- `scope(role)` counts what a block of code allocates under that role (the all-gather and
  reduce-scatter functions of FSDP2, DDP's bucket building).
"""

from __future__ import annotations

import contextlib
import weakref
from functools import partial

import torch

from pipeline.simulate.memory.tracker import CATEGORIES, LiveBytesTracker

SHARDED_CATEGORIES = CATEGORIES + ("unsharded_parameters", "all_gather", "reduce_scatter", "ddp_buckets")


def local_tensor(tensor):
    """The tensor that holds `tensor`'s bytes on this rank (a DTensor's local shard)."""
    return getattr(tensor, "_local_tensor", tensor)


def host_copy_stand_ins() -> dict:
    """A copy from a meta tensor into a host tensor leaves the host tensor as it was: under the fake
    process group a broadcast from rank 0 gives rank 0 back its own values (DDP syncs its bucket
    order that way), so the host tensor already holds them. With the collectives' own stand-ins
    (`collective_wrap_stand_ins`): every sharded simulation takes both."""
    aten = torch.ops.aten

    def copy_(func, args, kwargs):
        destination, source = args[0], args[1]
        if source.device.type == "meta" and destination.device.type != "meta":
            return destination
        return func(*args, **kwargs)

    return {aten.copy_.default: copy_, **collective_wrap_stand_ins()}


def collective_wrap_stand_ins() -> dict:
    """`_c10d_functional._wrap_tensor_autograd` (torch 2.12 on: a functional collective's result, `full_tensor()`'s
    among them, wrapped for autograd) returns its input wrapped, the same storage; its meta kernel makes a new tensor
    (`empty_like`), which would count the gathered tensor twice: a view of the input stands in for it."""
    import torch.distributed._functional_collectives  # noqa: F401 - registers the op (torch 2.12 on)

    wrap = getattr(torch.ops._c10d_functional, "_wrap_tensor_autograd", None)
    if wrap is None:
        return {}
    return {wrap.default: lambda func, args, kwargs: torch.ops.aten.alias.default(args[0])}


class SubclassAwareCache:
    """The meta output cache, skipped for ops on DTensors (it would remake them as plain tensors). An in-place op
    that returns nothing (the optimizers' `_fused_adamw_`, `_foreach_mul_`, ...) over DTensors of one mesh and one
    placement runs on their local tensors, as DTensor's dispatch would after proving that no redistribution is
    needed: that proof (its sharding propagation) is slow over lists of hundreds of parameters (a 70B model's
    optimizer step: 26 s of 72) and allocates nothing."""

    def __init__(self, cache):
        self.cache = cache

    def run(self, func, args, kwargs):
        from torch.distributed.tensor import DTensor

        dtensors = [a for a in _flat(args) if isinstance(a, DTensor)] + \
            [a for a in _flat(kwargs) if isinstance(a, DTensor)]
        if not dtensors:
            return self.cache.run(func, args, kwargs)
        if not func._schema.returns and _one_layout(dtensors):
            return func(*_locals(args), **dict(zip(kwargs, _locals(kwargs.values()))))
        return func(*args, **kwargs)


def _one_layout(dtensors) -> bool:
    """Whether the DTensors share their mesh and placements, none of them partial (a pending reduction)."""
    first = dtensors[0]
    return not any(p.is_partial() for p in first.placements) and all(
        d.device_mesh == first.device_mesh and d.placements == first.placements for d in dtensors)


def _locals(values) -> list:
    """`values` with each DTensor (in lists and tuples too) replaced by its local tensor."""
    from torch.distributed.tensor import DTensor

    def local(value):
        if isinstance(value, DTensor):
            return value._local_tensor
        if isinstance(value, (list, tuple)):
            return type(value)(local(v) for v in value)
        return value

    return [local(v) for v in values]


def _flat(value):
    if isinstance(value, dict):
        value = value.values()
    for item in value:
        if isinstance(item, (list, tuple)):
            yield from item
        else:
            yield item


class ShardedTracker(LiveBytesTracker):
    """LiveBytesTracker for FSDP2 / DDP steps (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.parts = dict.fromkeys(SHARDED_CATEGORIES, 0)
        if self.output_cache is not None:
            self.output_cache = SubclassAwareCache(self.output_cache)
        self._original_resize = None

    def track(self, tensor, category: str | None = None) -> None:
        super().track(local_tensor(tensor), category)

    def retag(self, tensor, category: str) -> None:
        super().retag(local_tensor(tensor), category)

    def bytes_of(self, tensors) -> int:
        return super().bytes_of([local_tensor(t) for t in tensors])

    def address_of(self, tensor):
        return super().address_of(local_tensor(tensor))

    @contextlib.contextmanager
    def scope(self, category: str):
        """New storages made inside count under `category`."""
        outer, self.category = self.category, category
        try:
            yield
        finally:
            self.category = outer

    def scoped(self, function, category: str):
        """`function` with its allocations counted under `category`."""
        def run(*args, **kwargs):
            with self.scope(category):
                return function(*args, **kwargs)

        run.__wrapped__ = function
        return run

    # -- storages resized in place (FSDP2's unsharded parameters) ------------------------------
    def __enter__(self):
        self._original_resize = original = torch.UntypedStorage.resize_

        def resize_(storage, nbytes):
            result = original(storage, nbytes)
            self.storage_resized(storage, int(nbytes))
            return result

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._original_resize
        return super().__exit__(*exc)

    def storage_resized(self, storage, nbytes: int) -> None:
        if storage.device.type != self.device_type:
            return
        if self.tape is not None:
            self.tape.append(("other",))
        entry = self.entries.get(id(storage))
        if entry is None:
            if nbytes > 0:
                self._new_entry(storage, nbytes)
        elif nbytes == 0:
            self._release(entry)
        elif entry[1] == 0:
            self._allocate(entry, nbytes)
        else:
            self._resized(entry, nbytes)
        self.note_peak()

    def _new_entry(self, storage, nbytes: int) -> None:
        key = id(storage)
        self.seq += 1
        self.entries[key] = [weakref.ref(storage, partial(self._freed, key)), 0, self.category, self.seq, None, None]
        self._allocate(self.entries[key], nbytes)

    def _allocate(self, entry, nbytes: int) -> None:
        address, size = self._malloc(nbytes)
        entry[1], entry[4], entry[5] = size, address, self._reserve(nbytes)
        self.parts[entry[2]] += size
        self.live += size

    def _release(self, entry) -> None:
        """A storage resized to 0 bytes: its block is freed, the storage object lives on."""
        if entry[4] is not None:
            self.allocator.free(entry[4])
        self._unreserve(entry[5])
        self.parts[entry[2]] -= entry[1]
        self.live -= entry[1]
        entry[1], entry[4], entry[5] = 0, None, None
