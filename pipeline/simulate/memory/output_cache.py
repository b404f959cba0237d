"""A cache of meta-kernel outputs: the simulator's speed-up, which changes no byte.

A transformer repeats the same ops layer after layer, and the meta kernels (Python reference
implementations) are slow; an op that writes no input and returns no alias of one can be answered
with fresh empty tensors of the remembered shapes, strides and dtypes.
"""

from __future__ import annotations

import torch


class MetaOutputCache:
    """Outputs of functional ops on meta tensors, remembered by the inputs' metadata."""

    LIMIT = 200_000  # entries; the cache starts over beyond it

    def __init__(self):
        self.functional = {}
        self.outputs = {}

    def run(self, func, args, kwargs):
        if not self._is_functional(func):
            return func(*args, **kwargs)
        try:
            # factories without a dtype follow torch's default dtype (a model built in bf16 sets it)
            key = (func, torch.get_default_dtype(), _describe(args), _describe(kwargs))
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
    def storages(values):
        for value in values:
            if isinstance(value, torch.Tensor):
                yield id(value.untyped_storage())
            elif isinstance(value, (list, tuple)):
                yield from storages(value)

    inputs = set(storages(args))
    return any(s in inputs for s in storages(out if isinstance(out, (list, tuple)) else (out,)))


def _describe(value):
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
    kind, items = recipe
    made = [torch.empty_strided(i[1], i[2], dtype=i[3], device="meta") if i[0] == "T" else i[1] for i in items]
    return made[0] if kind is None else kind(made)
