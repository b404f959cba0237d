"""Data-dependent values on the meta device: `.item()` answered from values that are known
(`UniformValues`), and the optimizers' _foreach_* ops without the slow per-tensor meta fallback."""

from __future__ import annotations

import functools

import torch


def scalar_stand_ins() -> dict:
    """`.item()` of a meta tensor answered from `UniformValues`, and fast _foreach_* ops."""
    aten = torch.ops.aten

    def item(func, args, kwargs):
        tensor = args[0]
        if tensor.device.type != "meta":
            return func(*args, **kwargs)
        value = getattr(tensor, "_simulated_value", None)
        if value is None:
            raise RuntimeError("a data-dependent value (.item()) of a meta tensor was needed")
        return value

    rules = {aten._local_scalar_dense.default: item, aten.is_nonzero.default: item}
    rules.update(foreach_stand_ins())
    return rules


class UniformValues:
    """Follows meta tensors whose elements all hold one known value, so that `.item()` on them
    can be answered: masks of ones, their sums and comparisons (transformers checks such masks
    before choosing an attention path). `x.all()` / `x.any()` of anything else count as true /
    false: transformers asks them about unusual inputs (padding, packed sequences)."""

    CONSTRUCTORS = {"ones": 1, "ones_like": 1, "new_ones": 1, "zeros": 0, "zeros_like": 0, "new_zeros": 0}
    FILLED = {"full": 1, "full_like": 1, "new_full": 2, "scalar_tensor": 0, "fill_": 1, "fill": 1}
    SAME_VALUE = frozenset({"mean", "amax", "amin", "max", "min", "_to_copy", "clone", "copy", "contiguous"})

    def __call__(self, func, args, kwargs, out):
        if not isinstance(out, torch.Tensor) or not out.is_meta:
            return
        value = self._value(func, args, kwargs, out)
        if value is not None:
            out._simulated_value = _as_python(value, out.dtype)
        elif hasattr(out, "_simulated_value") and func._schema.is_mutable:
            del out._simulated_value  # written in place with values we do not know

    def _value(self, func, args, kwargs, out):
        name = func._opname
        if name in self.CONSTRUCTORS:
            return self.CONSTRUCTORS[name]
        if name in self.FILLED:
            position = self.FILLED[name]
            return kwargs.get("fill_value", args[position] if len(args) > position else None)
        tensors, values = [], []
        for arg in args:
            if isinstance(arg, torch.Tensor):
                value = getattr(arg, "_simulated_value", None)
                if value is None:  # most ops: a tensor of unknown values
                    return {"all": True, "any": False}.get(name)
                tensors.append(arg)
                values.append(value)
        if not tensors:
            return {"all": True, "any": False}.get(name)
        source = tensors[0]
        if name in ("sum", "prod", "all", "any"):
            count = source.numel() // max(out.numel(), 1)
            return {"sum": values[0] * count, "prod": values[0] ** count,
                    "all": bool(values[0]) or count == 0, "any": bool(values[0]) and count > 0}[name]
        if name in self.SAME_VALUE or any(r.alias_info is not None for r in func._schema.returns):
            return values[0]
        if torch.Tag.pointwise in func.tags:
            proxies = [torch.tensor(getattr(a, "_simulated_value"), dtype=a.dtype)
                       if isinstance(a, torch.Tensor) else a for a in args]
            kwargs = {k: v for k, v in kwargs.items() if k != "device"}
            return func(*proxies, **kwargs).item()
        return None


def _as_python(value, dtype):
    if dtype == torch.bool:
        return bool(value)
    if dtype.is_floating_point:
        return float(value)
    return int(value)


@functools.lru_cache(maxsize=1)
def foreach_stand_ins() -> dict:
    """The optimizers' _foreach_* ops on meta tensors, without the slow per-tensor meta fallback:
    in-place ones allocate nothing, out-of-place ones one output like each input (as on CUDA).
    Built once per process (it reads every op schema); callers copy it into their own table."""
    aten = torch.ops.aten

    def in_place(func, args, kwargs):
        if _meta_list(args):
            return None
        return func(*args, **kwargs)

    def out_of_place(func, args, kwargs):
        tensors = _meta_list(args)
        if tensors is None:
            return func(*args, **kwargs)
        if func.__name__.startswith("_foreach_norm"):
            return [torch.empty((), dtype=t.dtype, device="meta") for t in tensors]
        return [torch.empty_like(t) for t in tensors]

    rules = {}
    names = {schema.name.split("::")[1] for schema in torch._C._jit_get_all_schemas()
             if schema.name.startswith("aten::_foreach_")}
    for name in sorted(names):
        packet = getattr(aten, name)
        for overload in packet.overloads():
            schema = getattr(packet, overload)._schema
            if schema.is_mutable and not schema.returns:
                rules[getattr(packet, overload)] = in_place
            elif not schema.is_mutable:
                rules[getattr(packet, overload)] = out_of_place
    return rules


def _meta_list(args):
    """The first list of tensors among `args` when it holds meta tensors, else None."""
    for arg in args:
        if isinstance(arg, (list, tuple)) and arg and hasattr(arg[0], "device"):
            return arg if arg[0].device.type == "meta" else None
    return None
