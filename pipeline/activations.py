"""Stage 3: parameter and activation counts of every registry model, on the meta device (no weights).

Two activation counts (DESIGN.md, binding):

- `hook` (the blog's method): sum of the tensor outputs of every module of `model.modules()` (a tensor,
  or the tensors inside a tuple/list output) in a forward of a (B, L) int64 input, eval mode,
  `no_grad`; elements, and bytes = elements x element size of the dtype.
- `saved`: bytes of the distinct storages that autograd saves during the forward of the standard
  training step (train mode, `use_cache=False`, `labels=ids`), the model's parameters and buffers
  excluded.

Forwards run on the meta device (`forward=meta`). When a forward needs a value that meta tensors do
not have (`Tensor.item()` in a data-dependent branch), it runs again with the values that follow
from the input ids computed for real on the CPU beside the meta tensors (`forward=meta-fallback`):
position ids, masks and packed-sequence checks get their true values, weights stay absent. What
still fails (branches on weight-derived values, e.g. MoE routing read with `.tolist()`) runs on the
CPU with real buffers and weights that take no memory (`forward=cpu`) when its activations fit,
else the row is an error with its reason.

Repeated layers are counted once (`replayed_layers`): once two consecutive layers of a decoder
stack with the same structure, attributes and input shapes have given the same counts, later such
layers add those counts without running (2-4x faster for the registry; counts identical to full
forwards on every registry model, checked in tests and on the whole registry).

Attention: meta tensors take the math kernel of scaled_dot_product_attention, which saves the
attention probabilities (B x heads x L x L per layer) for backward; CUDA's flash and
memory-efficient kernels save a log-sum-exp instead. The `saved` counts therefore grow with L^2
where CUDA's may not (bf16, and fp32 without grouped-query attention, use those kernels there).
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

from pipeline.errors import UserError
from pipeline.modeling import architecture_facts, parameter_counts

ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Precision modes of the saved-for-backward count (DESIGN.md): the dtype of the weights, and
# whether the forward runs under CUDA's autocast policy to bfloat16.
PRECISIONS = {"float32": ("float32", False), "bfloat16": ("bfloat16", False), "float16": ("float16", False),
              "amp-bf16": ("float32", True)}
# Element size used for the bytes of a precision (amp-bf16 computes the matmuls in bfloat16).
PRECISION_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "amp-bf16": 2}

HOOK_DTYPES = ("float32", "bfloat16")  # hook elements do not depend on the dtype: one forward, two rows
SAVED_PRECISIONS = ("float32", "bfloat16", "amp-bf16")


@dataclass(frozen=True)
class PointSet:
    """The (B, L) points of each method; L beyond a model's context length is skipped."""

    hook: tuple
    saved: tuple
    precisions: tuple = SAVED_PRECISIONS


HOOK_POINTS = ((1, 1), (1, 128), (1, 1024), (4, 512))
POINT_SETS = {
    "blog": PointSet(hook=((1, 1),), saved=(), precisions=()),
    "standard": PointSet(hook=HOOK_POINTS, saved=((1, 128), (1, 512), (1, 2048), (1, 8192), (4, 512))),
    "full": PointSet(hook=HOOK_POINTS,
                     saved=tuple((1, seq) for seq in (128, 256, 512, 1024, 2048, 4096, 8192)) + ((4, 512),)),
}
DEFAULT_POINTS = "standard"

# A meta forward costs the same at any L, except where the model loops over the sequence in Python
# (e.g. state-space models without their CUDA kernels). Once that shows, points whose estimated
# time passes this limit are skipped; no point runs longer than the hard limit.
POINT_ESTIMATE_LIMIT_S = 3.0
POINT_TIME_LIMIT_S = 60.0
MODEL_TIME_LIMIT_S = 300.0
# A CPU forward (the last path) holds its activations for real: it is tried only when they are
# likely (8 bytes x hook elements per token x tokens) to stay below this.
CPU_FORWARD_MAX_BYTES = 4 * 2**30
# Largest input-derived tensor whose values the meta-fallback computes on the CPU: (B, L) tensors
# such as position ids and padding masks, not (L, L) attention masks at long L.
TRACKED_VALUE_MAX_ELEMENTS = 2**15


# --------------------------------------------------------------------------------------------
# Meta-device forwards


class _DispatchModes:
    """The dispatch modes of the counting forwards (defined on first use: they need torch).

    `meta(track_values)`, the mode of every meta forward:
    - Shape cache: the Python meta kernels of many ops cost ~0.3 ms each; a decoder's layers repeat
      the same shapes, so outputs of functional ops are made from cached (size, stride, dtype).
    - `_grouped_mm` (MoE experts): its meta kernel accepts only bfloat16 (CUDA's fast path), while
      the real CPU and CUDA kernels take any float dtype through their fallback; the meta output is
      made with the input dtype.
    - Tracked values (meta-fallback): tensors whose values follow from known values (the input
      ids, factories such as arange) are also computed for real on the CPU, so that `.item()`,
      `nonzero` and friends on them give true answers; weights and what derives from them stay meta.

    `zero_weight_retry()`, the mode of CPU forwards with zero-stride weights: an op that refuses
    such a weight runs again with that weight materialised (one weight at a time).
    """

    classes = None

    @classmethod
    def meta(cls, track_values: bool, shape_cache: dict):
        return cls._classes()[0](track_values, shape_cache)

    @classmethod
    def zero_weight_retry(cls):
        return cls._classes()[1]()

    @classmethod
    def _classes(cls):
        if cls.classes is None:
            cls.classes = _define_dispatch_modes()
        return cls.classes


def _define_dispatch_modes():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    meta = torch.device("meta")
    relaxed_bf16_only = {aten._grouped_mm.default}
    cacheable: dict = {}
    writes: dict = {}

    def is_cacheable(func) -> bool:
        if func not in cacheable:
            schema = func._schema
            cacheable[func] = (
                not any(a.alias_info is not None for a in schema.arguments)
                and bool(schema.returns)
                and all(r.alias_info is None and str(r.type) == "Tensor" for r in schema.returns)
                and torch.Tag.dynamic_output_shape not in func.tags
                and torch.Tag.data_dependent_output not in func.tags
            )
        return cacheable[func]

    def written_arguments(func) -> tuple:
        if func not in writes:
            writes[func] = tuple(i for i, a in enumerate(func._schema.arguments)
                                 if a.alias_info is not None and a.alias_info.is_write)
        return writes[func]

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
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=meta)

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
            if tensor.device != meta:
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
            if func in relaxed_bf16_only and args[0].dtype != torch.bfloat16:
                out = func(*(a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                             for a in args), **kwargs)
                return torch.empty_strided(out.shape, out.stride(), dtype=args[0].dtype, device=meta)
            if not is_cacheable(func):
                return func(*args, **kwargs)
            key = (func, key_of(args), key_of(kwargs), torch.get_default_dtype())  # factories use the default
            cached = self.shape_cache.get(key)
            if cached is None:
                out = func(*args, **kwargs)
                outs = out if isinstance(out, tuple) else (out,)
                if all(isinstance(o, torch.Tensor) and o.device == meta for o in outs):
                    self.shape_cache[key] = (isinstance(out, tuple), [(o.shape, o.stride(), o.dtype) for o in outs])
                return out
            is_tuple, specs = cached
            outs = tuple(torch.empty_strided(s, st, dtype=d, device=meta) for s, st, d in specs)
            return outs if is_tuple else outs[0]

        def run_with_values(self, func, args, kwargs):
            """The op on meta, and on real values too when all its inputs have them and the result is small."""
            tensors = list(tensors_in(args, kwargs))
            if not (any(t.device == meta for t in tensors) or kwargs.get("device") == meta):
                return NotImplemented
            values = [self.value(t) for t in tensors]
            if any(v is None for v in values):
                self.mark_stale(func, args)
                return NotImplemented
            try:
                out = self.run_on_meta(func, args, kwargs)
            except Exception:  # noqa: BLE001 - data-dependent on meta (item, nonzero, copy to cpu): use values
                real = func(*self.real(args), **self.real(kwargs))
                if isinstance(real, torch.Tensor) and kwargs.get("device") in (None, meta):
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
                return {k: ("cpu" if k == "device" and v == meta else self.real(v)) for k, v in tree.items()}
            return tree

        def mark_stale(self, func, args):
            """An in-place op with unknown inputs leaves its target's values (and its aliases') unknown."""
            for index in written_arguments(func):
                if index < len(args) and isinstance(args[index], torch.Tensor):
                    self.stale_storages.add(args[index].untyped_storage()._cdata)

    products = {aten.mm.default, aten.bmm.default, aten._grouped_mm.default}
    products_plus_input = {aten.addmm.default, aten.baddbmm.default}

    def is_zero_weight(x) -> bool:
        """A zero expanded to a shape: how zero_weight_model stores weights (one element in memory)."""
        return (isinstance(x, torch.Tensor) and x.numel() > 1 and not any(x.stride())
                and x.as_strided((), ()).item() == 0)

    class ZeroWeightRetryMode(TorchDispatchMode):
        """CPU forwards with zero weights: a product with a zero weight is zeros (exactly, and without
        the work); an op that refuses an expanded weight runs again with it materialised."""

        def __init__(self):
            super().__init__()
            self.shapes = MetaDispatchMode(track_values=False, shape_cache={})

        def __torch_dispatch__(self, func, types, args, kwargs=None):
            kwargs = kwargs or {}
            if func in products or func in products_plus_input:
                factors = args[:2] if func in products else args[1:3]
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
            if func in products_plus_input:  # beta * input + alpha * (zero product)
                out += args[0] * kwargs.get("beta", 1)
            return out

    def materialise(x):
        return x.contiguous() if isinstance(x, torch.Tensor) and x.numel() > 1 and not any(x.stride()) else x

    return MetaDispatchMode, ZeroWeightRetryMode


def _cuda_autocast_emulation():
    """A TorchFunctionMode applying CUDA's autocast policy (to bfloat16) to tensors of any device.

    `torch.autocast` casts only tensors of its own device type, and meta tensors belong to none, so
    autocast("cpu"/"cuda") leaves a meta forward in float32. This mode casts at the same op
    boundaries as CUDA autocast (lists from the PyTorch AMP documentation), above autograd, so the
    casts and what the ops save are recorded as on CUDA; casts of parameters are cached per forward
    as autocast does.
    """
    import torch
    from torch.overrides import TorchFunctionMode

    lower = {"__matmul__", "addbmm", "addmm", "addmv", "addr", "baddbmm", "bmm", "chain_matmul", "multi_dot",
             "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
             "linear", "matmul", "mm", "mv", "prelu", "scaled_dot_product_attention"}
    fp32 = {"__pow__", "__rdiv__", "__rpow__", "__rtruediv__", "acos", "asin", "binary_cross_entropy_with_logits",
            "cosh", "cosine_embedding_loss", "cdist", "cosine_similarity", "cross_entropy", "cumprod", "cumsum",
            "dist", "erfinv", "exp", "expm1", "group_norm", "hinge_embedding_loss", "kl_div", "l1_loss",
            "layer_norm", "log", "log_softmax", "log10", "log1p", "log2", "margin_ranking_loss", "mse_loss",
            "multilabel_margin_loss", "multi_margin_loss", "nll_loss", "norm", "normalize", "pdist",
            "poisson_nll_loss", "pow", "prod", "reciprocal", "rsqrt", "sinh", "smooth_l1_loss",
            "soft_margin_loss", "softmax", "softmin", "softplus", "sum", "renorm", "tan", "triplet_margin_loss",
            "rms_norm"}
    promote = {"addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "grid_sample", "index_put",
               "scatter_add", "tensordot"}
    floating = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

    class CudaAutocast(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.cast_cache = {}

        def cast(self, x, dtype):
            if not isinstance(x, torch.Tensor) or x.dtype not in floating or x.dtype == dtype:
                return x
            if x.dtype == torch.float64 and dtype == torch.bfloat16:
                return x  # autocast leaves doubles alone
            if x.is_leaf and x.requires_grad:  # parameters: cast once per forward, as autocast does
                cached = self.cast_cache.get(id(x))
                if cached is None or cached[0] is not x:
                    cached = self.cast_cache[id(x)] = (x, x.to(dtype))
                return cached[1]
            return x.to(dtype)

        def cast_all(self, args, kwargs, dtype):
            args = tuple([self.cast(y, dtype) for y in a] if isinstance(a, (list, tuple)) else self.cast(a, dtype)
                         for a in args)
            return args, {k: self.cast(v, dtype) for k, v in kwargs.items()}

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = getattr(func, "__name__", "")
            if name in lower:
                args, kwargs = self.cast_all(args, kwargs, torch.bfloat16)
            elif name in fp32:
                args, kwargs = self.cast_all(args, kwargs, torch.float32)
            elif name in promote:
                widest = max((x.dtype for x in (*args, *kwargs.values())
                              if isinstance(x, torch.Tensor) and x.dtype in floating),
                             key=lambda d: torch.finfo(d).bits, default=None)
                if widest is not None:
                    args, kwargs = self.cast_all(args, kwargs, widest)
            return func(*args, **kwargs)

    return CudaAutocast()


# --------------------------------------------------------------------------------------------
# The two counts, each on one forward


def hook_elements(model, ids, replay: bool = False, tally: Tally | None = None) -> int:
    """The blog's method: numel of every module's tensor outputs, eval mode, no_grad."""
    import torch

    tally = tally or Tally()

    def add_outputs(module, inputs, output):
        if isinstance(output, torch.Tensor):
            tally.hook_elements += output.numel()
        elif isinstance(output, (tuple, list)):
            tally.hook_elements += sum(t.numel() for t in output if isinstance(t, torch.Tensor))

    handles = [module.register_forward_hook(add_outputs) for module in model.modules()]
    try:
        model.eval()
        with torch.no_grad(), replayed_layers(model, tally, replay):
            model(ids)
    finally:
        for handle in handles:
            handle.remove()
    return tally.hook_elements


def saved_storages(model, ids, autocast: bool = False, replay: bool = False,
                   tally: Tally | None = None) -> tuple[int, int]:
    """(bytes, elements) of the distinct storages autograd saves in the standard step's forward.

    Storages are told apart by their StorageImpl (`_cdata`), which views share and which stays
    unique while the storage is alive (meta tensors all have data_ptr 0); the model's parameters
    and buffers, and views of them, are excluded.
    """
    import torch

    state = {t.untyped_storage()._cdata for t in (*model.parameters(), *model.buffers())}
    storages = {}
    tally = tally or Tally()

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage._cdata not in state and storage._cdata not in storages:
            storages[storage._cdata] = storage
            tally.saved_bytes += storage.nbytes()
            tally.saved_elements += storage.nbytes() // tensor.element_size()
        # Not the tensor: a graph node saving its own output through a hook would hold itself (a
        # cycle through C++ that leaks). The storages above stay alive until the forward ends.
        return None

    model.train()
    with ExitStack() as stack:
        stack.enter_context(torch.enable_grad())
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda _: None))  # no backward
        if autocast:
            stack.enter_context(_cuda_autocast_emulation())
        stack.enter_context(replayed_layers(model, tally, replay, storages))
        model(input_ids=ids, labels=ids, use_cache=False)
    return tally.saved_bytes, tally.saved_elements


# --------------------------------------------------------------------------------------------
# Layer replay: a decoder's repeated layers counted once


@dataclass
class Tally:
    """The running counts of one counting forward."""

    hook_elements: int = 0
    saved_bytes: int = 0
    saved_elements: int = 0
    replayed_layers: int = 0  # layers whose counts were replayed, not run

    def snapshot(self) -> tuple:
        return self.hook_elements, self.saved_bytes, self.saved_elements

    def add(self, delta: tuple) -> None:
        self.hook_elements += delta[0]
        self.saved_bytes += delta[1]
        self.saved_elements += delta[2]


@contextmanager
def replayed_layers(model, tally: Tally, enabled: bool = True, saved: dict | None = None):
    """Within this context, layers of the model's decoder stack that repeat are not run.

    A layer's counts (what its submodules output, what it saves for backward) follow from its
    structure, its attributes and the shapes of its inputs. When two consecutive layers with the
    same signature gave the same counts and outputs, later layers with that signature add those
    counts to `tally` and return fresh tensors of the recorded shapes instead of running; the
    first layers of each signature (which also save what the whole stack shares, such as the
    rotary tables) run for real. A layer that saves its own output, or whose output is not plain
    meta tensors, is never replayed. Off for models that record layer outputs (router logits ...).
    """
    layers = decoder_layers(model) if enabled and not records_layer_outputs(model) else []
    seen = {}  # signature -> (counts, output spec, stable)

    def wrap(layer, forward):
        def replaying_forward(*args, **kwargs):
            signature = (layer_structure(layer), tensor_spec(args), tensor_spec(kwargs))
            known = seen.get(signature)
            if known is not None and known[2]:
                tally.add(known[0])
                tally.replayed_layers += 1
                return rebuild(known[1])
            before = tally.snapshot()
            output = forward(*args, **kwargs)
            counts = tuple(after - first for after, first in zip(tally.snapshot(), before))
            spec = output_spec(output, saved)
            stable = spec is not None and known is not None and known[:2] == (counts, spec)
            seen[signature] = (counts, spec, stable)
            return output
        return replaying_forward

    own = {id(layer): layer.__dict__["forward"] for layer in layers if "forward" in layer.__dict__}
    for layer in layers:
        layer.forward = wrap(layer, layer.forward)
    try:
        yield
    finally:
        for layer in layers:
            if id(layer) in own:
                layer.forward = own[id(layer)]  # a forward set on the instance (hooks of other tools)
            else:
                del layer.forward  # the class's forward again


def decoder_layers(model) -> list:
    """The layers of the model's top-level ModuleLists of 3 or more (not experts inside a layer)."""
    import torch

    layers, inside = [], []
    for name, module in model.named_modules():
        if any(name.startswith(prefix) for prefix in inside):
            continue
        if isinstance(module, torch.nn.ModuleList) and len(module) >= 3:
            layers.extend(module)
            inside.append(name + ".")
    return layers


def records_layer_outputs(model) -> bool:
    config = getattr(model, "config", None)
    return any(getattr(config, name, False) for name in
               ("output_router_logits", "output_hidden_states", "output_attentions"))


_INDEX_ATTRIBUTES = ("idx", "index", "layer_id", "layer_num")  # a layer's number: not part of its signature


def layer_structure(layer) -> tuple:
    """Classes, parameter and buffer shapes, and plain attributes of the layer and its submodules."""
    cached = getattr(layer, "_avp_structure", None)
    if cached is not None:
        return cached
    parts = []
    for name, module in layer.named_modules():
        attributes = tuple(sorted(
            (key, _hashable(value)) for key, value in vars(module).items()
            if not key.startswith("_") and not any(word in key for word in _INDEX_ATTRIBUTES)
            and _is_plain(value)))
        tensors = tuple((key, tuple(t.shape), t.dtype, t.requires_grad)
                        for key, t in (*module._parameters.items(), *module._buffers.items()) if t is not None)
        parts.append((name, type(module), attributes, tensors))
    layer._avp_structure = tuple(parts)
    return layer._avp_structure


def _is_plain(value) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_is_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def _hashable(value):
    return tuple(_hashable(v) for v in value) if isinstance(value, (list, tuple)) else value


def tensor_spec(tree):
    """What of a layer's arguments can change its counts: tensor shapes, strides, dtypes, devices,
    whether they need grad or carry tracked values; plain values; the type of anything else."""
    import torch

    if isinstance(tree, torch.Tensor):
        return ("tensor", tuple(tree.shape), tree.stride(), tree.dtype, tree.device.type, tree.requires_grad,
                hasattr(tree, "_avp_value"))
    if isinstance(tree, (list, tuple)):
        return (type(tree).__name__, tuple(tensor_spec(x) for x in tree))
    if isinstance(tree, dict):
        return ("dict", tuple((key, tensor_spec(value)) for key, value in tree.items()))
    if _is_plain(tree):
        return tree
    return ("object", type(tree).__qualname__)


def output_spec(output, saved: dict | None):
    """How to rebuild a layer's output (a meta tensor or a tuple of them and None), or None when
    it cannot be replayed: tensors off meta or with tracked values, other objects, or an output the
    layer itself saved (a later save of the rebuilt tensor would then count it twice)."""
    import torch

    def spec(x):
        if x is None:
            return None
        if (not isinstance(x, torch.Tensor) or x.device.type != "meta" or hasattr(x, "_avp_value")
                or (saved is not None and x.untyped_storage()._cdata in saved)):
            raise ValueError
        return (tuple(x.shape), x.stride(), x.dtype, x.requires_grad)

    try:
        if isinstance(output, tuple) and type(output) is tuple:
            return ("tuple", tuple(spec(x) for x in output))
        if output is None:
            return None
        return ("tensor", spec(output))
    except ValueError:
        return None


def rebuild(spec):
    import torch

    def tensor(s):
        if s is None:
            return None
        shape, stride, dtype, requires_grad = s
        return torch.empty_strided(shape, stride, dtype=dtype, device="meta").requires_grad_(requires_grad)

    kind, body = spec
    return tuple(tensor(s) for s in body) if kind == "tuple" else tensor(body)


# --------------------------------------------------------------------------------------------
# One model: forwards with fallback paths


FORWARD_PATHS = ("meta", "meta-fallback", "cpu")


class PointTimeout(BaseException):
    """Raised by the alarm; a BaseException so that no `except Exception` on the way swallows it."""


@dataclass
class Measurement:
    elements: int | None = None
    bytes: int | None = None
    forward: str | None = None
    status: str = "ok"
    reason: str | None = None
    seconds: float = 0.0


class ModelCounter:
    """One model's counting forwards: built on meta once per dtype, falling back path by path.

    Paths: `meta`; `meta-fallback` (input-derived values tracked, see _DispatchModes);
    `cpu`: a real CPU forward with real buffers and weights that take no memory (a zero expanded
    to the weight's shape), for branches on weight-derived values such as MoE routing with
    `.tolist()`; the math SDPA kernel is used there, as on meta.
    """

    def __init__(self, config, replay_layers: bool = True):
        self.config = config
        self.replay_layers = replay_layers  # see replayed_layers; never on the CPU path (real values)
        self.models = {}
        self.first_path = {"hook": "meta", "saved": "meta"}
        self.vocab_size = architecture_facts(config)["vocab_size"] or 2
        self.elements_per_token = None  # of the hook method, once measured
        self.shape_cache = {}
        self.last_tally = None  # of the last forward

    def model(self, dtype: str, device: str = "meta"):
        if (dtype, device) not in self.models:
            if device == "cpu":
                self.models = {key: m for key, m in self.models.items() if key[1] == "meta"}  # one at a time
                self.models[dtype, device] = zero_weight_model(self.config, dtype)
            else:
                self.models[dtype, device] = build_uninitialised(self.config, device, dtype)
        return self.models[dtype, device]

    def parameters(self) -> int:
        return sum(p.numel() for p in self.model("float32").parameters())

    def hook(self, batch: int, seq: int) -> Measurement:
        measurement = self.measure("hook", batch, seq, "float32")
        if measurement.status == "ok":
            self.elements_per_token = measurement.elements / (batch * seq)
        return measurement

    def saved(self, batch: int, seq: int, precision: str) -> Measurement:
        dtype, autocast = PRECISIONS[precision]
        return self.measure("saved", batch, seq, dtype, autocast)

    def measure(self, method: str, batch: int, seq: int, dtype: str, autocast: bool = False) -> Measurement:
        start = time.perf_counter()
        errors = []
        for path in FORWARD_PATHS[FORWARD_PATHS.index(self.first_path[method]):]:
            try:
                elements, nbytes = self.run(path, method, batch, seq, dtype, autocast)
            except PointTimeout:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure means: try the next path
                errors.append(f"{path}: {_one_line(exc)}")
                continue
            if path != "cpu":
                self.first_path[method] = path  # later points start where this one succeeded
            return Measurement(elements, nbytes, path, seconds=time.perf_counter() - start)
        return Measurement(status="error", reason="; ".join(errors), seconds=time.perf_counter() - start)

    def run(self, path: str, method: str, batch: int, seq: int, dtype: str, autocast: bool):
        """(elements, bytes) of one forward on `path`; bytes is None for the hook method."""
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        ids = self.input_ids(method, batch, seq)
        if path == "cpu":
            if autocast:
                raise RuntimeError("amp-bf16 is not counted on the CPU path (casts of zero weights would be free)")
            likely = 8 * (self.elements_per_token or 2e6) * batch * seq
            if likely > CPU_FORWARD_MAX_BYTES:
                raise RuntimeError(f"a CPU forward would hold about {likely / 2**30:.0f} GiB of activations")
            model = self.model(dtype, "cpu")
            with sdpa_kernel(SDPBackend.MATH), _DispatchModes.zero_weight_retry():
                return self.count(method, model, ids, autocast, replay=False)
        model = self.model(dtype)
        mode = _DispatchModes.meta(path == "meta-fallback", self.shape_cache)
        meta_ids = torch.empty(ids.shape, dtype=ids.dtype, device="meta")
        if path == "meta-fallback":
            mode.track(meta_ids, ids)
        with mode:
            return self.count(method, model, meta_ids, autocast, replay=self.replay_layers)

    def count(self, method: str, model, ids, autocast: bool, replay: bool):
        self.last_tally = Tally()
        if method == "hook":
            return hook_elements(model, ids, replay, self.last_tally), None
        nbytes, elements = saved_storages(model, ids, autocast, replay, self.last_tally)
        return elements, nbytes

    def input_ids(self, method: str, batch: int, seq: int):
        """The blog's zeros for the hook method; ids uniform over the vocabulary for the training step."""
        import torch

        if method == "hook":
            return torch.zeros((batch, seq), dtype=torch.int64)
        generator = torch.Generator().manual_seed(0)
        return torch.randint(0, self.vocab_size, (batch, seq), generator=generator)


def build_uninitialised(config, device: str, dtype: str):
    """pipeline.modeling.build_model without initialising the weights (their values never matter
    here; on meta this builds 2-5x faster), then tied as transformers' init_weights would tie them."""
    import torch
    from transformers.initialization import no_init_weights

    from pipeline.modeling import build_model

    with no_init_weights():
        model = build_model(config, device=device, dtype=getattr(torch, dtype))
    model.tie_weights(recompute_mapping=False)
    return model


def zero_weight_model(config, dtype: str):
    """The model on the CPU, with real buffers (rotary tables ...) and weights that take no memory.

    Built without weight initialisation (untouched allocations cost no memory), then each weight is
    replaced by a zero expanded to its shape; tied weights stay tied.
    """
    import torch

    model = build_uninitialised(config, "cpu", dtype)
    zeros = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and id(param) not in zeros:
                zero = torch.zeros((), dtype=param.dtype).expand(param.shape)
                zeros[id(param)] = torch.nn.Parameter(zero, requires_grad=param.requires_grad)
            if param is not None:
                module._parameters[name] = zeros[id(param)]
    return model


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}".rstrip(": ")


@contextmanager
def time_limit(seconds: float | None):
    """Raise PointTimeout in the main thread after `seconds` (no limit elsewhere or when None)."""
    import threading

    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise PointTimeout(f"time limit of {seconds:.0f} s reached")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class TimeEstimate:
    """Seconds a forward spends per sequence position, from the hook forwards (which run first, from
    L=1 to L=1024). A meta forward costs about the same at any L, except where the model loops over
    the sequence in Python (a recurrent scan without its CUDA kernel): then the cost grows with L."""

    def __init__(self):
        self.first = None  # (seq_len, seconds) of the first hook forward
        self.seconds_per_position = 0.0

    def observe(self, seq: int, seconds: float, method: str) -> None:
        if method != "hook":
            return  # a training forward costs more at any L: comparing it with a hook forward says nothing
        if self.first is None:
            self.first = (seq, seconds)
        elif seq > self.first[0]:  # the longest hook forward so far: the least noisy slope
            self.seconds_per_position = max(0.0, (seconds - self.first[1]) / (seq - self.first[0]))

    def seconds(self, seq: int, method: str) -> float:
        return self.seconds_per_position * seq * (2 if method == "saved" else 1)  # a training forward: ~2x


# --------------------------------------------------------------------------------------------
# Rows of models.parquet and activations.parquet for one model


MODEL_COLUMNS = (
    "model_id", "family", "model_type", "status", "reason", "config_source", "config_revision", "parameters",
    "embedding_parameters", "non_embedding_parameters", "active_parameters", "is_moe", "num_experts",
    "num_experts_per_tok", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
    "num_key_value_heads", "head_dim", "vocab_size", "context_length", "tie_word_embeddings", "attention_kind",
    "seconds",  # to count the model, building included
)
ACTIVATION_COLUMNS = (
    "model_id", "family", "model_type", "parameters", "method", "dtype", "batch_size", "seq_len", "tokens",
    "elements", "elements_per_token", "bytes", "bytes_per_token", "forward", "status", "reason", "seconds",
    "config_source", "config_revision",
)


@dataclass
class ModelJob:
    model_id: str
    family: str | None
    model_type: str | None
    config: object | None  # transformers config; None when there is none to count
    config_source: str | None = None
    config_revision: str | None = None
    skip_reason: str | None = None  # the configs stage skipped the model
    config_error: str | None = None  # the configs stage's config does not load


def count_model(job: ModelJob, points: PointSet = POINT_SETS[DEFAULT_POINTS]):
    """(models row, activation rows) of one model; a failure becomes rows with status and reason."""
    start = time.perf_counter()
    base = {"model_id": job.model_id, "family": job.family, "model_type": job.model_type,
            "config_source": job.config_source, "config_revision": job.config_revision}
    model_row = {**base, "status": "ok", "reason": None}
    rows = []
    if job.config is None:
        model_row.update(status="error" if job.config_error else "skipped", reason=job.config_error or job.skip_reason)
    else:
        try:
            counter = ModelCounter(job.config)
            model_row.update(architecture_facts(job.config))
            counts = parameter_counts(counter.model("float32"), job.config)
        except Exception as exc:  # noqa: BLE001 - a config transformers cannot build: the model is an error row
            model_row.update(status="error", reason=_one_line(exc))
        else:
            model_row.update({k: counts[k] for k in MODEL_COLUMNS if k in counts},
                             is_moe=bool(counts["routed_expert_parameters"]))
            base["parameters"] = counts["parameters"]
            wanted = [("hook", "float32", b, s) for b, s in points.hook]
            wanted += [("saved", p, b, s) for p in points.precisions for b, s in points.saved]
            rows = measure_points(counter, base, wanted, model_row["context_length"])
    model_row["seconds"] = round(time.perf_counter() - start, 3)
    return model_row, rows


def measure_points(counter: ModelCounter, base: dict, wanted: list, context: int | None) -> list[dict]:
    """One row per point (two per hook point: float32 and bfloat16 bytes), within the time limits."""
    estimate = TimeEstimate()
    deadline = time.perf_counter() + MODEL_TIME_LIMIT_S
    rows = []
    for method, dtype, batch, seq in wanted:
        left = deadline - time.perf_counter()
        if context and seq > context:
            measurement = Measurement(status="skipped", reason=f"seq_len {seq} beyond the context length {context}")
        elif (estimated := estimate.seconds(seq, method)) > POINT_ESTIMATE_LIMIT_S:
            measurement = Measurement(status="skipped", reason=(
                f"estimated {estimated:.0f} s: the forward's time grows with the sequence length"))
        elif left <= 0:
            measurement = Measurement(status="error", reason=f"model time limit of {MODEL_TIME_LIMIT_S:.0f} s reached")
        else:
            try:
                with time_limit(min(POINT_TIME_LIMIT_S, left)):
                    measurement = counter.hook(batch, seq) if method == "hook" else counter.saved(batch, seq, dtype)
                estimate.observe(seq, measurement.seconds, method)
            except PointTimeout as exc:
                measurement = Measurement(status="error", reason=str(exc))
        rows.extend(_rows(base, method, dtype, batch, seq, measurement))
    return rows


def _rows(base, method, dtype, batch, seq, measurement: Measurement) -> list[dict]:
    tokens = batch * seq
    ok = measurement.status == "ok"
    row = {
        **base, "method": method, "dtype": dtype, "batch_size": batch, "seq_len": seq, "tokens": tokens,
        "elements": measurement.elements if ok else None,
        "elements_per_token": measurement.elements / tokens if ok else None,
        "bytes": measurement.bytes if ok else None,
        "bytes_per_token": measurement.bytes / tokens if ok and measurement.bytes is not None else None,
        "forward": measurement.forward, "status": measurement.status, "reason": measurement.reason,
        "seconds": round(measurement.seconds, 4),
    }
    if method == "saved":
        return [row]
    rows = []
    for hook_dtype in HOOK_DTYPES:  # bytes = elements x element size of the dtype (DESIGN.md)
        nbytes = measurement.elements * ELEMENT_BYTES[hook_dtype] if ok else None
        rows.append({**row, "dtype": hook_dtype, "bytes": nbytes,
                     "bytes_per_token": nbytes / tokens if ok else None})
    return rows


# --------------------------------------------------------------------------------------------
# The stage: every registry model, in one process or a small pool forked after the imports


_WORK: dict = {"jobs": [], "points": None}  # read by forked workers


def read_jobs(registry_path, configs_path) -> list[ModelJob]:
    """One job per registry model, with the config the configs stage resolved (or why it has none)."""
    import json
    from pathlib import Path

    from pipeline.configs import config_from_dict
    from pipeline.registry import load_registry

    entries = load_registry(registry_path, check_model_types=False)
    try:
        records = json.loads(Path(configs_path).read_text())
    except FileNotFoundError:
        raise UserError(f"{configs_path}: configs file not found (run `python -m pipeline configs` first)") from None
    except json.JSONDecodeError:
        raise UserError(f"{configs_path}: not a JSON configs file") from None
    jobs = []
    for entry in entries:
        record = records.get(entry.id)
        job = ModelJob(entry.id, entry.family, entry.model_type, None)
        if record is None:
            job.skip_reason = f"not in {configs_path}"
        elif record.get("status") != "ok":
            job.skip_reason = record.get("reason") or "config skipped by the configs stage"
        else:
            job.config_source, job.config_revision = record["config_source"], record["config_revision"]
            try:
                job.config = config_from_dict(record["config"], entry.id)
            except UserError as exc:
                job.config_error = f"the configs stage's config does not load: {exc}"
        jobs.append(job)
    return jobs


def _count_job(index: int):
    import warnings

    warnings.filterwarnings("ignore")
    job = _WORK["jobs"][index]
    try:
        return index, count_model(job, _WORK["points"])
    except Exception as exc:  # noqa: BLE001 - whatever happens to one model, the stage goes on
        return index, ({"model_id": job.model_id, "family": job.family, "model_type": job.model_type,
                        "config_source": job.config_source, "config_revision": job.config_revision,
                        "status": "error", "reason": _one_line(exc)}, [])


def _init_worker():
    import torch

    torch.set_num_threads(1)


def count_all(jobs: list[ModelJob], workers: int = 2, points: PointSet = POINT_SETS[DEFAULT_POINTS],
              progress=None):
    """models and activations DataFrames for `jobs`; progress (done / total, elapsed) on `progress`."""
    import multiprocessing

    import pandas as pd

    from pipeline.provenance import provenance

    _quiet_transformers()
    gc.freeze()  # the imports' objects: out of every later collection, and shared copy-on-write by the workers
    progress = progress or sys.stderr
    _WORK.update(jobs=jobs, points=points)
    start = time.perf_counter()
    results = [None] * len(jobs)

    def report(done, index):
        job = jobs[index]
        status = results[index][0]["status"]
        elapsed = time.perf_counter() - start
        left = elapsed / done * (len(jobs) - done)
        print(f"activations: {done}/{len(jobs)} {job.model_id} {status} ({elapsed:.1f} s, about {left:.0f} s left)",
              file=progress, flush=True)

    if workers > 1 and len(jobs) > 1:
        with multiprocessing.get_context("fork").Pool(workers, initializer=_init_worker) as pool:
            for done, (index, result) in enumerate(pool.imap_unordered(_count_job, range(len(jobs))), 1):
                results[index] = result
                report(done, index)
    else:
        for index in range(len(jobs)):
            results[index] = _count_job(index)[1]
            report(index + 1, index)
    common = provenance()
    models = pd.DataFrame([{**row, **common} for row, _ in results], columns=[*MODEL_COLUMNS, *common])
    activations = pd.DataFrame([{**row, **common} for _, rows in results for row in rows],
                               columns=[*ACTIVATION_COLUMNS, *common])
    return _integer_columns(models), _integer_columns(activations)


def _integer_columns(frame):
    for column in frame.columns:
        if column in ("parameters", "embedding_parameters", "non_embedding_parameters", "active_parameters",
                      "num_experts", "num_experts_per_tok", "num_hidden_layers", "hidden_size",
                      "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
                      "context_length", "batch_size", "seq_len", "tokens", "elements", "bytes"):
            frame[column] = frame[column].astype("Int64")
    return frame


def _quiet_transformers():
    from transformers.utils import logging

    logging.set_verbosity_error()


def write_activations(registry_path, configs_path, models_out, activations_out, workers: int = 2,
                      model_ids: list[str] | None = None, points: str = DEFAULT_POINTS):
    """The stage: count every registry model and write both tables (each whole or not at all)."""
    from pipeline.io import write_parquet

    jobs = read_jobs(registry_path, configs_path)
    if model_ids:
        unknown = sorted(set(model_ids) - {job.model_id for job in jobs})
        if unknown:
            raise UserError(f"model {unknown[0]!r} is not in the registry")
        jobs = [job for job in jobs if job.model_id in model_ids]
    if points not in POINT_SETS:
        raise UserError(f"points {points!r} is not one of {', '.join(POINT_SETS)}")
    models, activations = count_all(jobs, workers, POINT_SETS[points])
    write_parquet(models, models_out)
    write_parquet(activations, activations_out)
    return models, activations


# --------------------------------------------------------------------------------------------
# count(): one model, for the command line and for Python users


def count(model: str | None = None, config: str | None = None, dtype: str = "float32", batch: int | None = None,
          seq: int | None = None, config_source: str = "auto", registry=None) -> dict:
    """Parameters and activations per token of one model (registry id, Hub id or config.json path).

    `elements_per_token` / `bytes_per_token` are the blog's hook method at (1, 1); with `batch` and
    `seq`, also the bytes saved for backward per token in the standard step at (batch, seq).
    """
    from pipeline.configs import resolve_model

    if dtype not in PRECISION_BYTES:
        raise UserError(f"dtype {dtype!r} is not one of {', '.join(PRECISION_BYTES)}")
    if (batch is None) != (seq is None):
        raise UserError("give both --batch and --seq, or neither")
    for name, value in (("batch", batch), ("seq", seq)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise UserError(f"{name} must be a positive integer, not {value!r}")
    _quiet_transformers()
    resolved = resolve_model(model, config, config_source, registry)
    counter = ModelCounter(resolved.config)
    try:
        counts = parameter_counts(counter.model("float32"), resolved.config)
    except Exception as exc:  # noqa: BLE001 - a config transformers cannot build is bad input here
        raise UserError(f"{resolved.model_id}: the model cannot be built ({_one_line(exc)})") from None
    hook = counter.hook(1, 1)
    if hook.status != "ok":
        raise UserError(f"{resolved.model_id}: the forward failed ({hook.reason})")
    result = {
        "model_id": resolved.model_id,
        "parameters": counts["parameters"],
        "embedding_parameters": counts["embedding_parameters"],
        "non_embedding_parameters": counts["non_embedding_parameters"],
        "active_parameters": counts["active_parameters"],
        "elements_per_token": hook.elements,
        "bytes_per_token": hook.elements * PRECISION_BYTES[dtype],
        "dtype": dtype,
        "method": "hook",
        "forward": hook.forward,
        "config_source": resolved.source,
        "config_revision": resolved.revision,
    }
    if batch is not None:
        saved = counter.saved(batch, seq, dtype)
        result.update(batch_size=batch, seq_len=seq, saved_forward=saved.forward,
                      saved_bytes=saved.bytes, saved_bytes_per_token=saved.bytes / (batch * seq) if saved.bytes else None)
        if saved.status != "ok":
            result["saved_reason"] = saved.reason
    return result


# --------------------------------------------------------------------------------------------
# Command line


def add_cli(subparsers) -> None:
    from pipeline.arguments import positive_int
    from pipeline.configs import CONFIG_SOURCES

    stage = subparsers.add_parser("activations", help="count parameters and activations of every registry model")
    stage.add_argument("--registry", default="models.yaml")
    stage.add_argument("--configs", default="results/configs.json", help="the configs stage's output")
    stage.add_argument("--models-out", default="results/models.parquet")
    stage.add_argument("--activations-out", default="results/activations.parquet")
    stage.add_argument("--workers", type=positive_int, default=min(2, os.cpu_count() or 1),
                       help="processes forked after the imports (default: 2)")
    stage.add_argument("--model", action="append", dest="models", metavar="ID", help="only these models (repeat)")
    stage.add_argument("--points", default=DEFAULT_POINTS, choices=list(POINT_SETS),
                       help="blog: the hook method at (1, 1) only; standard: hook at 4 points and saved-for-backward "
                            "at L=128..8192 in 3 precisions; full: saved at every power of 2 from 128 to 8192")
    stage.set_defaults(handler=_stage_command)

    one = subparsers.add_parser("count", help="parameters and activations per token of one model")
    source = one.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="registry or Hub model id")
    source.add_argument("--config", help="path of a Hugging Face config.json")
    one.add_argument("--dtype", default="float32", choices=list(PRECISION_BYTES))
    one.add_argument("--batch", type=positive_int)
    one.add_argument("--seq", type=positive_int)
    one.add_argument("--config-source", default="auto", choices=CONFIG_SOURCES)
    one.add_argument("--registry", default=None, help="registry file (default: models.yaml of the project)")
    one.add_argument("--json", action="store_true", help="print JSON")
    one.set_defaults(handler=_count_command)


def _stage_command(args) -> int:
    start = time.perf_counter()
    models, activations = write_activations(args.registry, args.configs, args.models_out, args.activations_out,
                                            args.workers, args.models, args.points)
    status = models["status"].value_counts().to_dict()
    print(f"activations: {len(models)} models ({', '.join(f'{k}: {v}' for k, v in sorted(status.items()))}), "
          f"{len(activations)} rows -> {args.models_out}, {args.activations_out} "
          f"in {time.perf_counter() - start:.1f} s")
    return 0


def _count_command(args) -> int:
    import json

    result = count(args.model, args.config, args.dtype, args.batch, args.seq, args.config_source, args.registry)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        width = max(map(len, result))
        for key, value in result.items():
            print(f"{key:<{width}}  {value:,}" if isinstance(value, int) and not isinstance(value, bool)
                  else f"{key:<{width}}  {value}")
    return 0
