"""Host shadows: the values of small meta tensors (token ids, labels, masks, counts), for the
data-dependent questions that a Trainer client's step asks of them.

Every micro-batch tensor moved to the meta device carries its host copy (`_shadow`). `Shadows` (an
observer of the tracker) re-runs on the host copies each op whose meta inputs all have shadows and
are small (`SHADOW_LIMIT`), and attaches the result to the op's meta output: so the shapes and
values that follow from labels are known exactly. `shadow_stand_ins` answers with them:

- `nonzero`, boolean indexing (`x[mask]`, which runs `nonzero`) and `masked_select`: the number of
  true elements, hence the output shape (TRL's fused LM head scores `hidden_states[labels != -100]`;
  the backward of its `masked_scatter` runs `masked_select`);
- `.item()` of counts (`num_valid > 0`, `attention_mask.sum().item()`, Liger's `target_mask.sum()`);
- `torch.equal` (Liger's `grad_output == 1` check): from shadows, else False (both branches of that
  check allocate nothing).

`.item()` of a floating-point value that no shadow knows (SFTTrainer's entropy and accuracy metrics,
which are logged, never used for memory) answers 0.0; `Shadows.unknown` lists each such call. Values
that `UniformValues` knows (masks of ones and their sums) are answered as before.
"""

from __future__ import annotations

import torch

from pipeline.simulate.values.stand_ins import UniformValues

SHADOW_LIMIT = 1 << 22  # elements: only index- and mask-sized tensors get host shadows
UNDEFINED_VALUES = frozenset({"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"})


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def on_host(value):
    """`value` with its meta tensors replaced by their host shadows (meta devices by the CPU)."""
    if isinstance(value, torch.Tensor):
        return value._shadow if value.device.type == "meta" else value
    if isinstance(value, (list, tuple)):
        return type(value)(on_host(v) for v in value)
    if isinstance(value, torch.device) and value.type == "meta":
        return torch.device("cpu")
    return value


def attach(out, shadow) -> None:
    """Give the meta tensors of `out` the host values of `shadow` (same structure and shapes)."""
    if isinstance(out, torch.Tensor) and isinstance(shadow, torch.Tensor):
        if out.device.type == "meta" and tuple(out.shape) == tuple(shadow.shape):
            out._shadow = shadow
    elif isinstance(out, (list, tuple)) and isinstance(shadow, (list, tuple)):
        for o, s in zip(out, shadow):
            attach(o, s)


def shadowed(host: torch.Tensor, device_type: str) -> torch.Tensor:
    """`host` moved to `device_type`; on meta the copy carries `host` as its shadow."""
    moved = host.to(device_type) if device_type == "meta" else host.clone()
    if device_type == "meta":
        moved._shadow = host
    return moved


class Shadows:
    """The tracker's observer: `UniformValues`, then host shadows propagated through every op whose meta
    inputs all have one (see the module docstring)."""

    def __init__(self, host_values: bool = False):
        self.uniform = UniformValues()
        self.unknown = []  # (dtype or "equal", shape) of the questions answered without a value
        # also the small tensors made on the device from host values or constants (`torch.tensor(...,
        # device=...)`, `.to(device)` of a host tensor, `torch.ones`, `torch.full`, `torch.arange`): generation's
        # token ids and stopping flags (`pipeline.simulate.clients.grpo`)
        self.host_values = host_values

    def __call__(self, func, args, kwargs, out):
        self.uniform(func, args, kwargs, out)
        inputs = [t for t in _tensors(list(args) + list(kwargs.values())) if t.device.type == "meta"]
        if not inputs:
            if self.host_values and func._opname not in UNDEFINED_VALUES and any(
                    t.device.type == "meta" and t.numel() <= SHADOW_LIMIT for t in _tensors(out)):
                try:
                    attach(out, func(*on_host(args), **{k: on_host(v) for k, v in kwargs.items()}))
                except Exception:  # noqa: BLE001 - an op the host cannot run: no shadow
                    pass
            return
        if all(hasattr(t, "_shadow") for t in inputs) and all(t.numel() <= SHADOW_LIMIT for t in inputs):
            try:
                shadow = func(*on_host(args), **{k: on_host(v) for k, v in kwargs.items()})
            except Exception:  # noqa: BLE001 - an op the host cannot run: no shadow
                shadow = None
            if shadow is not None:
                attach(out, shadow)
                return
        if func._schema.is_mutable:
            for t in _tensors(out):
                if hasattr(t, "_shadow"):
                    del t._shadow


def _shadow_of(t):
    shadow = getattr(t, "_shadow", None)
    if shadow is None:
        raise RuntimeError(f"a data-dependent shape needs the values of a meta tensor {tuple(t.shape)} "
                           f"{t.dtype} that no host shadow holds")
    return shadow


def _long_indices(indices) -> list:
    """Boolean masks (with shadows) as the long index tensors `nonzero` makes of them."""
    out = []
    for index in indices:
        if index is not None and index.device.type == "meta" and index.dtype in (torch.bool, torch.uint8):
            for column in _shadow_of(index).nonzero().unbind(1):
                t = torch.empty(column.shape, dtype=torch.long, device="meta")
                t._shadow = column
                out.append(t)
        else:
            out.append(index)
    return out


def shadow_stand_ins(shadows: Shadows) -> dict:
    """Dispatch stand-ins answering data-dependent questions from host shadows (module docstring)."""
    aten = torch.ops.aten

    def item(func, args, kwargs):
        t = args[0]
        if t.device.type != "meta":
            return func(*args, **kwargs)
        shadow = getattr(t, "_shadow", None)
        if shadow is not None:
            return func(shadow)
        value = getattr(t, "_simulated_value", None)
        if value is not None:
            return value
        if t.is_floating_point():
            shadows.unknown.append((t.dtype, tuple(t.shape)))
            return False if func is aten.is_nonzero.default else 0.0
        raise RuntimeError("a data-dependent value (.item()) of a meta tensor was needed")

    def nonzero(func, args, kwargs):
        t = args[0]
        if t.device.type != "meta":
            return func(*args, **kwargs)
        shadow = _shadow_of(t).nonzero()
        out = torch.empty(shadow.shape, dtype=torch.long, device="meta")
        out._shadow = shadow
        return out

    def index(func, args, kwargs):
        self, indices = args[0], args[1]
        if self.device.type != "meta" or not any(
                i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices):
            return func(*args, **kwargs)
        return func(self, _long_indices(indices), *args[2:], **kwargs)

    def masked_select(func, args, kwargs):
        self, mask = args[0], args[1]
        if self.device.type != "meta":
            return func(*args, **kwargs)
        count = int(torch.broadcast_to(_shadow_of(mask), torch.broadcast_shapes(self.shape, mask.shape)).sum())
        return torch.empty(count, dtype=self.dtype, device="meta")

    def equal(func, args, kwargs):
        if not any(t.device.type == "meta" for t in args):
            return func(*args, **kwargs)
        if all(hasattr(t, "_shadow") for t in args):
            return func(*on_host(args))
        shadows.unknown.append(("equal", tuple(args[0].shape)))
        return False

    def to_host(func, args, kwargs):
        t, device = args[0], kwargs.get("device")
        if t.device.type != "meta" or device is None or torch.device(device).type == "meta" \
                or not hasattr(t, "_shadow"):
            return func(*args, **kwargs)
        return func(t._shadow, *args[1:], **kwargs)  # `.cpu()` of token ids: their host values

    # `.cpu()` only where small tensors carry host values (generation's token ids): `_to_copy` is an op of every
    # autocast cast, which a stand-in would take off the output cache's path
    copies = {aten._to_copy.default: to_host} if shadows.host_values else {}
    return {**copies, aten.equal.default: equal, aten._local_scalar_dense.default: item, aten.is_nonzero.default: item,
            aten.nonzero.default: nonzero, aten.index.Tensor: index, aten.masked_select.default: masked_select}
