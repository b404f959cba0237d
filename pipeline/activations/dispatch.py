"""The dispatch modes of the counting forwards (imported by the counting code path only: torch).

`MetaDispatchMode(track_values, shape_cache)`, the mode of every meta forward:
- Shape cache: the Python meta kernels of many ops cost ~0.3 ms each; a decoder's layers repeat
  the same shapes, so outputs of functional ops are made from cached (size, stride, dtype).
- `_grouped_mm` (MoE experts): its meta kernel accepts only bfloat16 (CUDA's fast path), while
  the real CPU and CUDA kernels take any float dtype through their fallback; the meta output is
  made with the input dtype.
- Tracked values (meta-fallback): tensors whose values follow from known values (the input
  ids, factories such as arange) are also computed for real on the CPU, so that `.item()`,
  `nonzero` and friends on them give true answers; weights and what derives from them stay meta.

`ZeroWeightRetryMode()`, the mode of CPU forwards with zero-stride weights: an op that refuses
such a weight runs again with that weight materialised (one weight at a time).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
META = torch.device("meta")
RELAXED_BF16_ONLY = {aten._grouped_mm.default}
PRODUCTS = {aten.mm.default, aten.bmm.default, aten._grouped_mm.default}
PRODUCTS_PLUS_INPUT = {aten.addmm.default, aten.baddbmm.default}
# Largest input-derived tensor whose values the meta-fallback computes on the CPU: (B, L) tensors
# such as position ids and padding masks, not (L, L) attention masks at long L.
TRACKED_VALUE_MAX_ELEMENTS = 2**15

_cacheable: dict = {}
_writes: dict = {}


def is_cacheable(func) -> bool:
    if func not in _cacheable:
        schema = func._schema
        _cacheable[func] = (
            not any(a.alias_info is not None for a in schema.arguments)
            and bool(schema.returns)
            and all(r.alias_info is None and str(r.type) == "Tensor" for r in schema.returns)
            and torch.Tag.dynamic_output_shape not in func.tags
            and torch.Tag.data_dependent_output not in func.tags
        )
    return _cacheable[func]


def written_arguments(func) -> tuple:
    if func not in _writes:
        _writes[func] = tuple(i for i, a in enumerate(func._schema.arguments)
                              if a.alias_info is not None and a.alias_info.is_write)
    return _writes[func]


def key_of(x):
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), x.stride(), x.dtype, x.device.type)
    if isinstance(x, (list, tuple)):
        return tuple(key_of(y) for y in x)
    if isinstance(x, dict):
        return tuple((k, key_of(v)) for k, v in x.items())
    return x


def tensors_in(args, kwargs):
    for x in (*args, *kwargs.values()):
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, (list, tuple)):
            yield from (y for y in x if isinstance(y, torch.Tensor))


def empty_meta_like(x):
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=META)


class MetaDispatchMode(TorchDispatchMode):
    def __init__(self, track_values: bool, shape_cache: dict):
        super().__init__()
        self.track_values = track_values
        self.shape_cache = shape_cache  # one per model: its layers repeat shapes
        self.stale_storages = set()  # written in place from unknown values

    def track(self, meta_tensor, value) -> None:
        """Give a meta tensor (e.g. the input ids) its real value."""
        meta_tensor._avp_value = (self, value)

    def value(self, tensor):
        """The real value of a tensor: itself off meta, its tracked value on meta, else None."""
        if tensor.device != META:
            return tensor
        tracked = getattr(tensor, "_avp_value", None)
        if tracked is None or tracked[0] is not self:
            return None
        if tensor.untyped_storage()._cdata in self.stale_storages:
            return None
        return tracked[1]

    def __torch_dispatch__(self, func, types, args, kwargs=None):
        kwargs = kwargs or {}
        if self.track_values:
            result = self.run_with_values(func, args, kwargs)
            if result is not NotImplemented:
                return result
        return self.run_on_meta(func, args, kwargs)

    def run_on_meta(self, func, args, kwargs):
        if func in RELAXED_BF16_ONLY and args[0].dtype != torch.bfloat16:
            out = func(*(a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                         for a in args), **kwargs)
            return torch.empty_strided(out.shape, out.stride(), dtype=args[0].dtype, device=META)
        if not is_cacheable(func):
            return func(*args, **kwargs)
        key = (func, key_of(args), key_of(kwargs), torch.get_default_dtype())  # factories use the default
        cached = self.shape_cache.get(key)
        if cached is None:
            out = func(*args, **kwargs)
            outs = out if isinstance(out, tuple) else (out,)
            if all(isinstance(o, torch.Tensor) and o.device == META for o in outs):
                self.shape_cache[key] = (isinstance(out, tuple), [(o.shape, o.stride(), o.dtype) for o in outs])
            return out
        is_tuple, specs = cached
        outs = tuple(torch.empty_strided(s, st, dtype=d, device=META) for s, st, d in specs)
        return outs if is_tuple else outs[0]

    def run_with_values(self, func, args, kwargs):
        """The op on meta, and on real values too when all its inputs have them and the result is small."""
        tensors = list(tensors_in(args, kwargs))
        if not (any(t.device == META for t in tensors) or kwargs.get("device") == META):
            return NotImplemented
        values = [self.value(t) for t in tensors]
        if any(v is None for v in values):
            self.mark_stale(func, args)
            return NotImplemented
        try:
            out = self.run_on_meta(func, args, kwargs)
        except Exception:  # noqa: BLE001 - data-dependent on meta (item, nonzero, copy to cpu): use values
            real = func(*self.real(args), **self.real(kwargs))
            if isinstance(real, torch.Tensor) and kwargs.get("device") in (None, META):
                out = empty_meta_like(real)
                self.track(out, real)
                return out
            return real  # a number (.item(), equal ...) or a tensor the caller wanted off meta
        outs = out if isinstance(out, (list, tuple)) else (out,)
        if all(isinstance(o, torch.Tensor) and o.numel() <= TRACKED_VALUE_MAX_ELEMENTS for o in outs):
            real = func(*self.real(args), **self.real(kwargs))
            for meta_out, real_out in zip(outs, real if isinstance(out, (list, tuple)) else (real,)):
                self.track(meta_out, real_out)
        return out

    def real(self, tree):
        if isinstance(tree, torch.Tensor):
            return self.value(tree)
        if isinstance(tree, (list, tuple)):
            return type(tree)(self.real(x) for x in tree)
        if isinstance(tree, dict):
            return {k: ("cpu" if k == "device" and v == META else self.real(v)) for k, v in tree.items()}
        return tree

    def mark_stale(self, func, args):
        """An in-place op with unknown inputs leaves its target's values (and its aliases') unknown."""
        for index in written_arguments(func):
            if index < len(args) and isinstance(args[index], torch.Tensor):
                self.stale_storages.add(args[index].untyped_storage()._cdata)


def is_zero_weight(x) -> bool:
    """A zero expanded to a shape: how zero_weight_model stores weights (one element in memory)."""
    return (isinstance(x, torch.Tensor) and x.numel() > 1 and not any(x.stride())
            and x.as_strided((), ()).item() == 0)


def materialise(x):
    return x.contiguous() if isinstance(x, torch.Tensor) and x.numel() > 1 and not any(x.stride()) else x


class ZeroWeightRetryMode(TorchDispatchMode):
    """CPU forwards with zero weights: a product with a zero weight is zeros (exactly, and without
    the work); an op that refuses an expanded weight runs again with it materialised."""

    def __init__(self):
        super().__init__()
        self.shapes = MetaDispatchMode(track_values=False, shape_cache={})

    def __torch_dispatch__(self, func, types, args, kwargs=None):
        kwargs = kwargs or {}
        if func in PRODUCTS or func in PRODUCTS_PLUS_INPUT:
            factors = args[:2] if func in PRODUCTS else args[1:3]
            if any(is_zero_weight(f) for f in factors):
                return self.zero_product(func, args, kwargs)
        try:
            return func(*args, **kwargs)
        except RuntimeError:
            if not any(a.numel() > 1 and not any(a.stride()) for a in tensors_in(args, kwargs)):
                raise
        return func(*[[materialise(y) for y in a] if isinstance(a, (list, tuple)) else materialise(a) for a in args],
                    **{k: materialise(v) for k, v in kwargs.items()})

    def zero_product(self, func, args, kwargs):
        on_meta = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]
        shape = self.shapes.run_on_meta(func, on_meta, {k: v.to("meta") if isinstance(v, torch.Tensor) else v
                                                         for k, v in kwargs.items()})
        out = torch.zeros(shape.shape, dtype=shape.dtype)
        if func in PRODUCTS_PLUS_INPUT:  # beta * input + alpha * (zero product)
            out += args[0] * kwargs.get("beta", 1)
        return out
