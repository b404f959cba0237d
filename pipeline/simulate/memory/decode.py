"""Generation's decode steps replayed instead of traced: the exact answer for long completions in seconds.

`generate` runs the model once per new token: with 1,024-token completions a GRPO step runs a 28-layer model a
thousand times, and tracing each op of those steps was most of the simulation's time. Yet from its second step
on, a decode step with a `DynamicCache` makes the same requests of the allocator in the same order, step after
step, only longer by one token where they hold the cache or read it: its storages' sizes are affine in the step.
So the first steps are traced, their events recorded (the tracker's tape: every storage made and freed, the
kernels' scratch space, the peak checks, each stream), and when three consecutive steps agree (the same events,
sizes moving by the same bytes), each later step is replayed: the same events, at its sizes, fed to the
tracker's live bytes and both allocator replays, in order; then the storages that outlive the step (the cache's
grown keys and values, the logits) are made as meta tensors of the step's shapes and take their blocks, the cache
is given them, and the step's output is returned. The allocators see every request the traced step would have
made, so the peak, the reserved bytes and the segments come out as a traced run's.

Checked, not assumed: every `CHECK_EVERY`-th step and the last one are traced, and their events compared with
what the replay would have made; any difference raises `DecodeDiverged`, and the simulation is run again with
every step traced (`simulate.api.simulate`). Anything the replay cannot make (a storage resized in place,
FSDP2's gathers, a phase change, a sliding-window or hybrid cache, an output beside the logits and the cache) and
the steps are traced as before.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

RECORDED = 4  # decode steps traced first: the first after the prefill differs (it frees the prefill's cache)
CHECK_EVERY = 128
_enabled = True


class DecodeDiverged(RuntimeError):
    """A traced check step's events are not what the replay would have made (`simulate.api.simulate` re-runs)."""


@contextlib.contextmanager
def replay_disabled():
    """Every decode step traced (after a `DecodeDiverged`)."""
    global _enabled
    saved, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = saved


@dataclass(frozen=True)
class StepEvents:
    """One decode step's tape, its storages numbered in the order made, split into what must be the same from step
    to step (`events`, `survivors`) and the numbers that may move (`sizes`, in order). Events: ("alloc", stream,
    category), its bytes in `sizes`; ("free", "here" | "before", index); ("scratch", count), its sizes in `sizes`;
    ("peak",), its extra bytes in `sizes`. Survivors, the storages alive after the step: (index, role, dtype,
    ndim), their shapes in `sizes` after the events'; role: ("cache", layer, "keys" | "values") or ("logits",)."""

    events: tuple
    survivors: tuple
    sizes: tuple

    def at(self, sizes) -> StepEvents:
        return StepEvents(self.events, self.survivors, tuple(sizes))


class Template:
    """Three consecutive steps that agree: the events of step `first + k` are step `first`'s, its sizes moved k
    times by the difference between the second and the first."""

    def __init__(self, first: int, steps: list):
        self.first, self.base = first, steps[0]
        a, b, c = (step.sizes for step in steps)
        self.delta = [y - x for x, y in zip(a, b)]
        self.valid = all((s.events, s.survivors) == (self.base.events, self.base.survivors) for s in steps) and \
            len(a) == len(b) == len(c) and all(z - y == d for y, z, d in zip(b, c, self.delta))

    def step(self, index: int) -> StepEvents:
        k = index - self.first
        return self.base.at(x + k * d for x, d in zip(self.base.sizes, self.delta))


class DecodeReplay:
    """`GenerationMixin._sample` with its decode steps' forward replayed where they repeat (module docstring);
    used as a context around the run (`installed`)."""

    def __init__(self, tracker):
        self.tracker = tracker

    @contextlib.contextmanager
    def installed(self):
        from transformers.generation.utils import GenerationMixin

        if not _enabled or self.tracker.device_type != "meta":
            yield
            return
        original, tracker = GenerationMixin._sample, self.tracker

        def sample(model, *args, **kwargs):
            decode = Decode(tracker, model, kwargs["generation_config"].max_new_tokens)
            model.__call__ = decode.forward  # what `_sample` calls per decode step (`self.__call__`)
            try:
                out = original(model, *args, **kwargs)
            finally:
                model.__dict__.pop("__call__", None)
            decode.finished()
            return out

        GenerationMixin._sample = sample
        try:
            yield
        finally:
            GenerationMixin._sample = original


class Decode:
    """One `_sample` call's decode steps (`DecodeReplay`)."""

    def __init__(self, tracker, model, new_tokens: int | None):
        self.tracker, self.model = tracker, model
        self.last = (new_tokens or 0) - 1  # decode steps after the prefill, each running to max_new_tokens
        self.index = 0
        self.recorded = []
        self.template = None
        self.before = {}  # the previous step's survivors: index -> tracker key
        self.usable = True
        self.output_type = None

    def finished(self) -> None:
        """Generation ended: steps replayed after the last check (an early stop) were never compared."""
        if self.template is not None and self.index % CHECK_EVERY and self.index != self.last:
            raise DecodeDiverged(f"generation stopped at decode step {self.index}, before its last check")

    def forward(self, *args, **kwargs):
        self.index += 1
        traced = type(self.model).__call__
        if not self.usable or args:
            return traced(self.model, *args, **kwargs)
        if self.template is None or self.index % CHECK_EVERY == 0 or self.index == self.last:
            return self.traced(traced, kwargs)
        return self.replayed(kwargs)

    def traced(self, traced, kwargs):
        tracker = self.tracker
        tracker.tape = []
        try:
            out = traced(self.model, **kwargs)
        finally:
            tape, tracker.tape = tracker.tape, None
        step = self.numbered(tape, kwargs.get("past_key_values"), out)
        if step is None and self.template is not None:
            raise DecodeDiverged(f"decode step {self.index}: events the replay cannot make")
        if step is None:
            self.usable = False
            return out
        if self.template is not None:
            if step != self.template.step(self.index):
                raise DecodeDiverged(f"decode step {self.index}: the traced events differ from the replay's")
        elif self.index > 1:
            self.recorded.append(step)
            if len(self.recorded) == RECORDED - 1:
                template = Template(self.index - 2, self.recorded)
                self.usable, self.template = template.valid, template if template.valid else None
        return out

    def numbered(self, tape, cache, out) -> StepEvents | None:
        """The tape with its storages numbered, and its survivors' roles; None if it cannot be replayed. The
        first step frees the prefill's cache, made before any tape: those frees are left out of its events."""
        if getattr(out, "loss", None) is not None or not cacheable(cache):
            return None
        here, before = {}, {key: index for index, key in self.before.items()}
        events, sizes, count = [], [], 0
        for event in tape:
            kind = event[0]
            if kind == "alloc":
                here[event[1]] = count
                count += 1
                events.append(("alloc", event[3], event[4]))
                sizes.append(event[2])
            elif kind == "free":
                if event[1] in here:
                    events.append(("free", "here", here.pop(event[1])))
                elif event[1] in before:
                    events.append(("free", "before", before.pop(event[1])))
                elif self.index > 1:
                    return None
            elif kind == "scratch":
                events.append(("scratch", len(event[1])))
                sizes.extend(event[1])
            elif kind == "peak":
                events.append(("peak",))
                sizes.append(event[1])
            else:
                return None
        roles = {}
        for layer, cached in enumerate(cache.layers):
            roles[id(cached.keys.untyped_storage())] = (("cache", layer, "keys"), cached.keys)
            roles[id(cached.values.untyped_storage())] = (("cache", layer, "values"), cached.values)
        roles[id(out.logits.untyped_storage())] = (("logits",), out.logits)
        survivors = []
        for key, index in sorted(here.items(), key=lambda item: item[1]):
            if key not in roles:
                return None
            role, tensor = roles[key]
            if not tensor.is_contiguous() or tensor.storage_offset():
                return None
            survivors.append((index, role, tensor.dtype, tensor.dim()))
            sizes.extend(tensor.shape)
        if any(v is not None for k, v in out.items() if k not in ("logits", "past_key_values")):
            return None
        self.before = {index: key for key, index in here.items()}
        self.output_type = type(out)
        return StepEvents(tuple(events), tuple(survivors), tuple(sizes))

    def replayed(self, kwargs):
        import torch
        from torch.utils._python_dispatch import _disable_current_modes

        step, tracker, cache = self.template.step(self.index), self.tracker, kwargs["past_key_values"]
        sizes, keys = iter(step.sizes), []
        for event in step.events:
            kind = event[0]
            if kind == "alloc":
                keys.append(tracker.replayed_alloc(next(sizes), event[1], event[2]))
            elif kind == "free":
                tracker.replayed_free(keys[event[2]] if event[1] == "here" else self.before[event[2]])
            elif kind == "scratch":
                tracker.scratch([next(sizes) for _ in range(event[1])])
            else:
                tracker.note_peak(next(sizes))
        logits, self.before = None, {}
        with _disable_current_modes():
            made = [(index, role, torch.empty([next(sizes) for _ in range(ndim)], dtype=dtype, device="meta"))
                    for index, role, dtype, ndim in step.survivors]
        for index, role, tensor in made:
            tracker.adopt(keys[index], tensor)
            self.before[index] = id(tensor.untyped_storage())
            if role[0] == "logits":
                logits = tensor
            else:
                setattr(cache.layers[role[1]], role[2], tensor)
        return self.output_type(logits=logits, past_key_values=cache)


def cacheable(cache) -> bool:
    """A cache whose every layer grows by one token a step: transformers' DynamicCache of DynamicLayers."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)
