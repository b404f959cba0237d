"""CUDA's autocast policy, for tensors that `torch.autocast` does not cover (the meta device).

`torch.autocast` casts only tensors of its own device type, and meta tensors belong to none, so a
meta forward under autocast("cuda") stays in float32. `CudaAutocast` is a TorchFunctionMode that
casts at the same op boundaries as CUDA autocast (the op lists of aten/src/ATen/autocast_mode.h),
above autograd, so the casts and what the ops save for backward are recorded as on CUDA; casts of
weights are cached until the outermost autocast exits, as CUDA's cast cache is.

    with CudaAutocast(device_type="meta").autocast(torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss

CUDA autocast acts at the dispatcher, below the composite (CompositeImplicitAutograd) ops that
decompose into other aten ops: `torch.square(x)` runs as `pow(x, 2)`, which CUDA autocast computes in
fp32 (and `1 / x` as `reciprocal(x)`). A TorchFunctionMode sees the Python-level name only, so
`COMPOSITE_OPS` names, for each such entry point the registry's architectures call, the listed aten op
its decomposition runs first, and the emulation casts as for that op (relu-squared MLPs: nanochat,
BitNet, Nemotron, Nemotron-H, Persimmon; `tests/test_simulate.py` checks the table against the
dispatcher on their forwards).

Model code may also ask for the autocast state and act on it: Nemotron's LayerNorm1P casts its
inputs to the autocast dtype itself and normalises with autocast off; rotary embeddings compute
their angles with autocast off (transformers' `maybe_autocast(enabled=False)`). While the emulation
is on, `torch.is_autocast_enabled`, `torch.get_autocast_dtype` and transformers' `maybe_autocast`
answer for it (`model_code_view`), as torch's own answer for CUDA tensors.

This module is the project's one copy of the op lists and of the casting rule; the simulator's
kernel rules (`pipeline.simulate.kernels.rules.KernelRules`) extend the class.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

from pipeline.core.patches import attributes_set

# CUDA autocast op lists, by the Python name that reaches a TorchFunctionMode (aten name, or the
# Tensor dunder / torch.nn.functional name for the same op).
LOWER_PRECISION_OPS = frozenset({
    "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "convolution", "prelu", "addmm", "addmv", "addr", "matmul", "__matmul__",
    "__rmatmul__", "einsum", "mm", "mv", "linalg_vecdot", "vecdot", "linear", "addbmm", "baddbmm", "bmm",
    "chain_matmul", "multi_dot", "linalg_multi_dot", "lstm_cell", "gru_cell", "rnn_tanh_cell",
    "rnn_relu_cell", "scaled_dot_product_attention",
})
FP32_OPS = frozenset({
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal",
    "rsqrt", "sinh", "tan", "pow", "__pow__", "__rpow__", "float_power", "softplus", "layer_norm",
    "native_layer_norm", "group_norm", "frobenius_norm", "nuclear_norm", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss",
    "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss",
    "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    # composite Python entry points whose first inner op is on the fp32 lists
    "cross_entropy", "interpolate",
})
FP32_SET_DTYPE_OPS = frozenset({
    "prod", "softmax", "log_softmax", "cumprod", "cumsum", "linalg_vector_norm", "vector_norm",
    "linalg_matrix_norm", "matrix_norm", "sum", "norm",
})
PROMOTE_OPS = frozenset({
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
    "tensordot", "scatter_add",
})
# Composite Python entry points that the op lists above do not name but whose decomposition starts with an
# op they do: CUDA autocast casts that inner op's inputs, so the entry point is cast as that op.
COMPOSITE_OPS = {"square": "pow", "__rdiv__": "reciprocal", "__rtruediv__": "reciprocal"}
AUTOCAST_OPS = LOWER_PRECISION_OPS | FP32_OPS | FP32_SET_DTYPE_OPS | PROMOTE_OPS
# where a dtype may be given positionally (after the tensor), by Python entry point
DTYPE_POSITION = {"softmax": (3, 2), "log_softmax": (3, 2)}


class CudaAutocast(TorchFunctionMode):
    """CUDA's autocast for tensors of `device_type`, switched on by `autocast(dtype)`.

    Entered alone it changes nothing until `autocast` is on; `autocast` enters the mode itself
    when it is not active. Subclasses replace kernels in `call`, which sees the cast arguments.
    """

    def __init__(self, device_type: str = "meta"):
        super().__init__()
        self.device_type = device_type
        self.autocast_dtype = None
        self.autocast_depth = 0
        self.cast_cache = {}

    @contextlib.contextmanager
    def autocast(self, dtype=None, enabled: bool = True):
        """Like torch.autocast("cuda", dtype): casts by CUDA's op lists, weight casts cached."""
        previous = self.autocast_dtype
        self.autocast_dtype = (dtype or torch.bfloat16) if enabled else None
        self.autocast_depth += 1
        try:
            with contextlib.nullcontext() if self.active() else self, \
                    self.model_code_view() if self.autocast_depth == 1 else contextlib.nullcontext():
                yield
        finally:
            self.autocast_depth -= 1
            self.autocast_dtype = previous
            if self.autocast_depth == 0:
                self.cast_cache.clear()

    @contextlib.contextmanager
    def model_code_view(self):
        """torch's autocast queries and transformers' maybe_autocast answer for this emulation (the module
        docstring says why); restored when the outermost `autocast` exits."""
        import sys

        def is_enabled(*args, **kwargs):
            return self.autocast_dtype is not None

        def get_dtype(*args, **kwargs):
            return self.autocast_dtype or torch.bfloat16

        def maybe_autocast(device_type=None, dtype=None, enabled=True, cache_enabled=None):
            if not enabled:
                return self.autocast(enabled=False)
            if self.autocast_dtype is None:
                return contextlib.nullcontext()
            return self.autocast(dtype or self.autocast_dtype)

        generic = sys.modules.get("transformers.utils.generic")
        original = vars(generic).get("maybe_autocast") if generic is not None else None
        patches = [(torch, "is_autocast_enabled", is_enabled), (torch, "get_autocast_dtype", get_dtype)]
        if original is not None:
            patches += [(module, "maybe_autocast", maybe_autocast) for module in holders_of(original)]
        with attributes_set(patches):
            yield

    def active(self) -> bool:
        """Whether this mode is on the current TorchFunctionMode stack (backward runs outside it)."""
        return self in torch.overrides._get_current_function_mode_stack()

    def eligible(self, t) -> bool:
        return (isinstance(t, torch.Tensor) and t.device.type == self.device_type
                and t.is_floating_point() and t.dtype != torch.float64)

    def cast(self, t, dtype):
        if not self.eligible(t) or t.dtype == dtype:
            return t
        cacheable = (dtype == self.autocast_dtype and t.dtype == torch.float32 and t.requires_grad
                     and t.is_leaf and not t._is_view())
        if not cacheable:
            return t.to(dtype)
        hit = self.cast_cache.get(id(t))
        if hit is None or hit[0] is not t:
            hit = self.cast_cache[id(t)] = (t, t.to(dtype))
        return hit[1]

    def cast_all(self, value, dtype):
        if isinstance(value, (list, tuple)):
            return type(value)(self.cast_all(v, dtype) for v in value)
        return self.cast(value, dtype)

    def autocast_args(self, name: str, args, kwargs):
        """The arguments of op `name` as CUDA autocast passes them on. A call with `out=` is not cast:
        CUDA registers its autocast kernels for the functional overloads only (`mm`, `addmm`, not
        `mm.out`), so `torch.addmm(acc, a, b, out=acc)` runs as written (its fp32 `out` stays fp32)."""
        if "out" in kwargs:
            return args, kwargs
        name = COMPOSITE_OPS.get(name, name)
        if name in LOWER_PRECISION_OPS:
            dtype = self.autocast_dtype
        elif name in FP32_OPS:
            dtype = torch.float32
        elif name in FP32_SET_DTYPE_OPS:
            return args, self._fp32_dtype_kwargs(name, args, kwargs)
        elif name in PROMOTE_OPS:
            floats = [t.dtype for t in args if self.eligible(t)]
            dtype = torch.float32 if torch.float32 in floats else None
            if dtype is None:
                return args, kwargs
        else:
            return args, kwargs
        args = tuple(self.cast_all(a, dtype) for a in args)
        kwargs = {k: self.cast_all(v, dtype) for k, v in kwargs.items()}
        return args, kwargs

    def _fp32_dtype_kwargs(self, name: str, args, kwargs) -> dict:
        """Reductions compute in fp32 unless a dtype is given (by keyword or position)."""
        first = args[0] if args else None
        given = kwargs.get("dtype")
        for position in DTYPE_POSITION.get(name, ()):
            if given is None and len(args) > position and isinstance(args[position], torch.dtype):
                given = args[position]
        if given is None and self.eligible(first):
            return dict(kwargs, dtype=torch.float32)
        return kwargs

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", None)
        if self.autocast_dtype is not None and name is not None:
            args, kwargs = self.autocast_args(name, args, kwargs)
        return self.call(func, name, args, kwargs)

    def call(self, func, name: str | None, args, kwargs):
        """Run the op (after the casts)."""
        return func(*args, **kwargs)

    def wrap_checkpointing(self, model) -> None:
        """Checkpointed layers recompute under the autocast state of their forward, as
        torch.utils.checkpoint does for CUDA (it cannot see this emulation on meta tensors)."""
        for module in model.modules():
            original = getattr(module, "_gradient_checkpointing_func", None)
            if original is None or getattr(original, "_simulated", False):
                continue
            module._gradient_checkpointing_func = self.checkpoint_with_state(original)

    def checkpoint_with_state(self, original):
        """`original` (torch.utils.checkpoint.checkpoint or a partial of it) recomputing under the
        autocast state of the forward that called it."""
        def checkpoint(function, *args, **kwargs):
            dtype = self.autocast_dtype

            def run(*inner_args, **inner_kwargs):
                # the recompute runs inside backward, where no TorchFunctionMode is active: autocast
                # enters this mode again
                with self.autocast(dtype, enabled=dtype is not None):
                    return function(*inner_args, **inner_kwargs)

            return original(run, *args, **kwargs)

        checkpoint._simulated = True
        return checkpoint


_HOLDERS: dict = {}


def holders_of(maybe_autocast) -> list:
    """The transformers modules that imported `maybe_autocast`: scanned again only when modules were imported
    (once per layer, a scan of every module cost a 70B simulation 2 seconds)."""
    import sys

    key = (id(maybe_autocast), len(sys.modules))
    if key not in _HOLDERS:
        _HOLDERS.clear()
        _HOLDERS[key] = [module for name, module in list(sys.modules.items())
                         if name.startswith("transformers") and vars(module).get("maybe_autocast") is maybe_autocast]
    return _HOLDERS[key]
