"""Live-byte accounting of a training step, the way the CUDA caching allocator counts it.

`LiveBytesTracker` is a TorchDispatchMode: every storage that an op creates on the tracked device
is counted (rounded up like `torch.cuda.max_memory_allocated` counts blocks) until its last
reference goes (a weakref callback on the storage, as in torch.distributed._tools.MemTracker).
It keeps the running peak, per phase, with the bytes split by role at the peak moment.

`workspace_rules` ({aten overload: fn(args, kwargs, out) -> [bytes, ...]}) add the scratch space
that kernels allocate inside one op (invisible on the meta device); `stand_ins` ({aten overload:
fn(func, args, kwargs) -> out}) replace ops, e.g. to answer data-dependent questions (`.item()`)
that the meta device cannot; `observer(func, args, kwargs, out)` sees every op; `allocator` (an
`allocator.CachingAllocator`) counts blocks the way the CUDA caching allocator does instead of
requests rounded to 512 bytes; `reserved_allocator` (another one) replays the same allocations
plus the kernels' scratch memory (allocated and freed inside the op) for the reserved bytes, apart
so that the allocated-bytes replay stays as it was tuned; `host_outputs` ({op: fn(args, kwargs) ->
output indices}) names outputs that CUDA keeps on the host; `after_outputs(func, args, kwargs)`, when
set, runs after an op's outputs are counted (what a kernel allocates then and keeps: cuBLAS's
workspaces, `kernels.CublasWorkspaces`).

On several GPUs two more things matter. `stream` (a callable naming the stream the code runs on, None: one
stream) gives each request to its stream's pools in both replays. And a model given on the host (the CPU, as
`from_pretrained` leaves it) is not on the GPU until the code moves it there: while `on_host` is set
(`placed(host=True)`), storages made are the host's and not counted; a tensor that arrives on the GPU is
counted from that moment (`pipeline.simulate.distributed.world`).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from functools import partial

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pipeline.simulate.memory.allocator import allocated_bytes
from pipeline.simulate.memory.output_cache import SHARED_OUTPUT_CACHE

CATEGORIES = ("parameters", "gradients", "optimizer_state", "optimizer_intermediates", "activations")


@dataclass
class Snapshot:
    """Live bytes at one moment: the total, split by role, and the allocation count then."""

    total: int = 0
    parts: dict = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    seq: int = -1


def _host_scalar_ops() -> frozenset:
    """Ops that make 0-dim tensors from Python numbers: on CUDA they stay on the host (AdamW's
    `step` counters, masks' fill values), so a real CPU run must not count them either."""
    aten = torch.ops.aten
    return frozenset({aten.lift_fresh.default, aten.scalar_tensor.default})


class LiveBytesTracker(TorchDispatchMode):
    """Live bytes on `device_type` by role, and their peak per phase (see the module docstring)."""

    def __init__(self, device_type: str, workspace_rules: dict | None = None, stand_ins: dict | None = None,
                 observer=None, allocator=None, host_outputs=None, reserved_allocator=None):
        super().__init__()
        self.observer = observer
        self.allocator = allocator
        self.reserved_allocator = reserved_allocator
        self.host_outputs = host_outputs or {}
        self.device_type = device_type
        self.workspace_rules = workspace_rules or {}
        self.stand_ins = stand_ins or {}
        self.after_outputs = None
        self.untracked_ops = _host_scalar_ops() if device_type == "cpu" else ()
        self.output_cache = SHARED_OUTPUT_CACHE if device_type == "meta" else None
        self.plans = {}  # id(op) -> (op, its stand-in, host outputs and workspace rule, untracked?): `plan`
        self.entries = {}  # id(storage) -> [weakref, bytes, category, seq, address, reserved address]
        self.parts = dict.fromkeys(CATEGORIES, 0)
        self.live = 0
        self.seq = 0
        self.category = "activations"
        self.phase = None
        self.peaks = {}  # "total" and each phase name -> Snapshot
        self.stream = None  # () -> the current stream's name (FSDP2's side streams); None: the default stream
        self.on_host = False  # storages made now are on the host: not counted
        # decides per op whether it runs on the host (ZeRO-Offload: `distributed.zero.HostOnMeta`); None: never
        self.host_placement = None
        # a list while `decode.DecodeReplay` records a decode step: ("alloc", key, nbytes, stream, category),
        # ("free", key), ("scratch", sizes), ("peak", extra), and ("other",) for what it cannot replay
        self.tape = None

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """No torch._dynamo wrapper around `__torch_dispatch__` (torch's opt-out for modes): nothing here
        runs under torch.compile, and the wrapper costs a frame switch on every op."""
        return False

    # -- accounting -------------------------------------------------------------------------
    def track(self, tensor, category: str | None = None) -> None:
        """Count `tensor`'s storage from now until it is freed (no-op if already counted).

        Storages that exist before the step (weights) are allocated in the order given, as
        the model's build allocated them."""
        if not tensor.is_meta if self.device_type == "meta" else tensor.device.type != self.device_type:
            return
        storage = tensor.untyped_storage()
        key = id(storage)
        nbytes = storage.nbytes()
        entry = self.entries.get(key)
        if entry is not None:
            self._resized(entry, nbytes)
            return
        if self.on_host or (self.host_placement is not None and self.host_placement.is_host(tensor)):
            if self.tape is not None:
                self.tape.append(("other",))
            return
        stream = self.stream() if self.stream else 0
        self.entries[key] = self._new_block(nbytes, stream, category or self.category,
                                            weakref.ref(storage, partial(self._freed, key)))
        if self.tape is not None:
            self.tape.append(("alloc", key, nbytes, stream, self.entries[key][2]))

    def _new_block(self, nbytes: int, stream, category: str, ref) -> list:
        """A new storage's entry: its blocks in both replays, counted under `category`."""
        address, size = self._malloc(nbytes, stream)
        self.seq += 1
        self.parts[category] += size
        self.live += size
        return [ref, size, category, self.seq, address, self._reserve(nbytes, stream)]

    def _malloc(self, nbytes: int, stream=None):
        if self.allocator is None or nbytes <= 0:
            return None, allocated_bytes(nbytes)
        return self.allocator.malloc(nbytes, stream if stream is not None else self.stream() if self.stream else 0)

    def _reserve(self, nbytes: int, stream=None):
        if not self.reserved_allocator or nbytes <= 0:
            return None
        return self.reserved_allocator.malloc(nbytes, stream if stream is not None else
                                              self.stream() if self.stream else 0)[0]

    # -- a decode step replayed (`decode.DecodeReplay`): its blocks before its tensors ----------------------
    def replayed_alloc(self, nbytes: int, stream, category: str) -> object:
        """A storage's allocation as `track` counts it, for no tensor yet: its key (`adopt` gives it one)."""
        key = object()
        self.entries[key] = self._new_block(nbytes, stream, category, None)
        return key

    def replayed_free(self, key) -> None:
        """A storage freed as its last reference going frees it (`_freed`)."""
        self._freed(key, None)

    def adopt(self, key, tensor) -> None:
        """`tensor`'s storage (made outside the tracker) takes the entry of `replayed_alloc`'s `key`."""
        storage = tensor.untyped_storage()
        entry = self.entries.pop(key)
        entry[0] = weakref.ref(storage, partial(self._freed, id(storage)))
        self.entries[id(storage)] = entry

    def is_counted(self, tensor) -> bool:
        """Whether `tensor`'s storage is counted (on the simulated GPU), not the host's."""
        return id(tensor.untyped_storage()) in self.entries

    @contextlib.contextmanager
    def placed(self, host: bool):
        """Storages made in the block are the host's (`host`), or the GPU's."""
        saved, self.on_host = self.on_host, host
        try:
            yield
        finally:
            self.on_host = saved

    def reset_peaks(self) -> None:
        """The peak counters reset, as `torch.cuda.reset_peak_memory_stats()` does: peaks start from what is live."""
        self.peaks = {}
        if self.reserved_allocator is not None:
            for allocator in getattr(self.reserved_allocator, "allocators", [self.reserved_allocator]):
                allocator.peak = allocator.reserved
        self.note_peak()

    def _unreserve(self, address) -> None:
        if address is not None:
            self.reserved_allocator.free(address)

    def empty_cache(self) -> None:
        """torch.cuda.empty_cache(): the cached segments that are one free block go back, in the allocated
        bytes' replay and the reserved one."""
        if self.tape is not None:
            self.tape.append(("other",))
        for allocator in (self.allocator, self.reserved_allocator):
            if allocator is not None:
                allocator.empty_cache()

    def created(self, tensor) -> int | None:
        """The allocation count at which `tensor`'s storage was counted (None if it is not): a peak's
        `Snapshot.seq` below it was before the storage existed."""
        entry = self.entries.get(id(tensor.untyped_storage()))
        return entry[3] if entry is not None else None

    def address_of(self, tensor):
        """The reserved allocator's block of `tensor`'s storage (None if not counted)."""
        entry = self.entries.get(id(tensor.untyped_storage()))
        return entry[5] if entry is not None else None

    def _resized(self, entry, nbytes: int) -> None:
        """A storage that an op grew in place (`resize_`, `out=` arguments)."""
        if allocated_bytes(nbytes) <= entry[1]:
            return  # storages only grow; a grown one is a new block (the old one freed after the copy)
        if self.tape is not None:
            self.tape.append(("other",))
        address, size = self._malloc(nbytes)
        if entry[4] is not None:
            self.allocator.free(entry[4])
        reserved_address = self._reserve(nbytes)
        self._unreserve(entry[5])
        self.parts[entry[2]] += size - entry[1]
        self.live += size - entry[1]
        entry[1], entry[4], entry[5] = size, address, reserved_address

    def _freed(self, key, _ref) -> None:
        entry = self.entries.pop(key, None)
        if entry is not None:
            if self.tape is not None:
                self.tape.append(("free", key))
            self.parts[entry[2]] -= entry[1]
            self.live -= entry[1]
            if entry[4] is not None:
                self.allocator.free(entry[4])
            self._unreserve(entry[5])

    def retag(self, tensor, category: str) -> None:
        """Give a counted storage another role (a gradient, an optimizer moment).

        Peaks recorded after the storage was created had it under its old role; they are
        corrected too, since a storage alive now and created before a peak was alive then.
        """
        entry = self.entries.get(id(tensor.untyped_storage()))
        if entry is None or entry[2] == category:
            return
        if self.tape is not None:
            self.tape.append(("other",))
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
        if self.tape is not None:
            self.tape.append(("peak", extra))
        self._peak(extra)

    def _peak(self, extra: int) -> None:
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
        if self.tape is not None:
            self.tape.append(("other",))
        self.phase = phase
        self.category = category
        self.note_peak()

    # -- dispatch -----------------------------------------------------------------------------
    def plan(self, func) -> tuple:
        """What the tables given at construction say about an op, looked up once per op."""
        plan = self.plans[id(func)] = (func, self.stand_ins.get(func), self.host_outputs.get(func),
                                       self.workspace_rules.get(func), func in self.untracked_ops)
        return plan

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.host_placement is None:
            return self._dispatch(func, args, kwargs)
        args, kwargs, host = self.host_placement.place(func, args, kwargs)
        if not host:
            return self._dispatch(func, args, kwargs)
        with self.placed(host=True):
            out = self._dispatch(func, args, kwargs)
        self.host_placement.made(out)
        return out

    def _dispatch(self, func, args, kwargs):
        _, stand_in, host_outputs, rule, untracked = self.plans.get(id(func)) or self.plan(func)
        if stand_in is not None:
            out = stand_in(func, args, kwargs)
        elif self.output_cache is not None:
            out = self.output_cache.run(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        if self.observer is not None:
            self.observer(func, args, kwargs, out)
        if untracked:
            return out
        skip = host_outputs(args, kwargs) if host_outputs is not None else ()
        if isinstance(out, (tuple, list)):
            for index, t in enumerate(out):
                if hasattr(t, "untyped_storage") and index not in skip:
                    self.track(t)
        elif hasattr(out, "untyped_storage") and 0 not in skip:
            self.track(out)
        if self.after_outputs is not None:
            self.after_outputs(func, args, kwargs)
        if rule is None:
            self.note_peak()
            return out
        self.scratch(rule(args, kwargs, out))
        return out

    def scratch(self, sizes) -> None:
        """A kernel's scratch space: allocated and freed inside its op, counted at its peak."""
        if self.tape is not None:
            self.tape.append(("scratch", tuple(sizes)))
        for address in [self._reserve(n) for n in sizes]:
            self._unreserve(address)
        self._peak(sum(allocated_bytes(n) for n in sizes))  # the tape's scratch event implies it
