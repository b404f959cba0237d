"""What CUDA does differently from the meta device, as a small table of rules.

The simulator runs the real transformers/PyTorch training step on meta tensors. Almost all of
its memory behaviour is device independent (same Python, same composite ops, same autograd
graph). What is not, and is mirrored here:

- scaled_dot_product_attention: which kernel CUDA picks (`choose_sdpa_backend`) and what that
  kernel saves for backward (we call the same aten kernel, whose meta version returns the same
  outputs); the meta device itself would always run the math composite.
- autocast("cuda", bfloat16): the meta device has no autocast, so `KernelRules.autocast` mirrors
  CUDA's op lists and its cache of weight casts (kept until the outermost autocast exits).
- scratch memory that a CUDA kernel allocates inside one op (`workspace_rules`) and the cuBLAS
  workspaces (`CUBLAS_WORKSPACES`, one per thread that runs matmuls).
- data-dependent values (`.item()`) that the meta device cannot compute (`scalar_stand_ins`).
"""

from __future__ import annotations

import contextlib
import functools
import math
from contextlib import contextmanager

# Which kernels the H200 build picks; a table so that data can correct it.
SDPA_RULES = {
    "prefer_cudnn": False,  # cuDNN attention first (newer builds with cuDNN > 9.15 on sm90)
    "flash_max_head_dim": 256,
    "efficient_supports_gqa": False,  # True: mem-efficient takes k/v with fewer heads than q
}
# cuBLAS workspaces, allocated through the caching allocator on the first matmul of each thread
# (the forward's and the autograd engine's: 32 MiB each on sm90) plus 1 MiB (cuBLASLt), and kept:
# the sweep measures each point after earlier ones in the same process, so they are there from
# the start. Measured: pythia-14m's peaks exceed the simulation by 65 MiB in every phase, at
# every (B, L) and precision.
CUBLAS_WORKSPACES = (32 << 20, 32 << 20, 1 << 20)

# CUDA autocast op lists (aten/src/ATen/autocast_mode.h), by the Python name that reaches a
# TorchFunctionMode (aten name, or the Tensor dunder / torch.nn.functional name for the same op).
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
# where a dtype may be given positionally (after the tensor), by Python entry point
DTYPE_POSITION = {"softmax": (3, 2), "log_softmax": (3, 2)}


def choose_sdpa_backend(query, key, value, attn_mask, dropout_p: float, enable_gqa: bool) -> str:
    """The kernel torch's CUDA select_sdp_backend picks on sm90: cudnn, flash, efficient or math."""
    import torch

    half = query.dtype in (torch.float16, torch.bfloat16)
    head_dim, value_dim = query.shape[-1], value.shape[-1]
    same_heads = query.shape[-3] == key.shape[-3]
    if not same_heads and not enable_gqa:
        return "math"
    if half and SDPA_RULES["prefer_cudnn"] and head_dim == value_dim and head_dim <= 128:
        return "cudnn"
    if (half and attn_mask is None and head_dim == key.shape[-1] == value_dim
            and head_dim <= SDPA_RULES["flash_max_head_dim"]):
        return "flash"
    alignment = 8 if half else 4
    if (head_dim == key.shape[-1] and head_dim % alignment == 0 and value_dim % alignment == 0
            and (same_heads or SDPA_RULES["efficient_supports_gqa"])):
        return "efficient"
    return "math"


def _bool_mask_to_additive(mask, dtype):
    import torch

    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask.logical_not(), float("-inf"))


def _pad_last_dim(tensor, alignment: int):
    """CUDA sdpa pads a head dim or mask width that is not a multiple of `alignment` (a copy)."""
    import torch.nn.functional as F

    size = tensor.shape[-1]
    if size % alignment == 0:
        return tensor
    return F.pad(tensor, (0, alignment - size % alignment))


def cuda_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False):
    """F.scaled_dot_product_attention as CUDA runs it: the same kernel, hence the same saved tensors."""
    import torch

    aten = torch.ops.aten
    attn_mask = _bool_mask_to_additive(attn_mask, query.dtype)
    backend = choose_sdpa_backend(query, key, value, attn_mask, dropout_p, enable_gqa)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    if backend == "flash":
        head_dim = query.shape[-1]
        scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
        q, k, v = (_pad_last_dim(t, 8) for t in (query, key, value))
        out = aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0]
        return out[..., :head_dim] if out.shape[-1] != head_dim else out
    if backend == "cudnn":
        return aten._scaled_dot_product_cudnn_attention(
            query, key, value, attn_mask, needs_grad, dropout_p, is_causal, False, scale=scale)[0]
    if backend == "efficient":
        if attn_mask is not None:
            width = attn_mask.shape[-1]
            attn_mask = _pad_last_dim(attn_mask, 16)[..., :width].expand(
                query.shape[0], query.shape[1], query.shape[2], key.shape[2])
        return aten._scaled_dot_product_efficient_attention(
            query, key, value, attn_mask, needs_grad, dropout_p, is_causal, scale=scale)[0]
    return math_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def math_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """aten::_scaled_dot_product_attention_math (attention.cpp) as CUDA runs it, op for op.

    Three things differ from running that composite on the meta device: the mask is added in
    place (the composite adds out of place under a dispatch mode, which counts as a tensor
    subclass), dropout is CUDA's fused kernel (a bool mask), and `_safe_softmax` allocates what
    the H200 shows (`SafeSoftmax`).
    """
    import torch

    origin_dtype = query.dtype
    if origin_dtype in (torch.float16, torch.bfloat16):  # the math kernel computes in fp32
        query, key, value = query.float(), key.float(), value.float()
    scaling = math.sqrt(scale if scale is not None else 1.0 / math.sqrt(query.shape[-1]))
    query = query * scaling
    if is_causal:
        causal = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device).tril()
        attn_mask = torch.where(causal, torch.scalar_tensor(0.0, dtype=query.dtype, device=query.device),
                                torch.scalar_tensor(float("-inf"), dtype=query.dtype, device=query.device))
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        key = key.repeat_interleave(query.shape[-3] // key.shape[-3], -3)
        value = value.repeat_interleave(query.shape[-3] // value.shape[-3], -3)
    attn = torch.matmul(query, key.transpose(-2, -1) * scaling)
    if attn_mask is not None:
        attn.add_(attn_mask)
    attn = _safe_softmax_function().apply(attn)
    if dropout_p > 0.0:
        attn = torch.native_dropout(attn, dropout_p, True)[0]
    return torch.matmul(attn, value).to(origin_dtype)


@functools.cache
def _safe_softmax_function():
    """aten::_safe_softmax over the last dim, with the memory its CUDA backward shows: one more
    buffer the size of the probabilities while the gradient is computed (measured: fp32 math-kernel
    rows of SmolLM2-135M/360M and TinyLlama peak one (B, H, L, L) fp32 tensor above the meta
    kernels' count in the backward, with and without checkpointing; eager attention's softmax
    does not). Its forward keeps a bool mask of the input alive (workspace rule)."""
    import torch

    class SafeSoftmax(torch.autograd.Function):
        @staticmethod
        def forward(ctx, scores):
            probabilities = torch.ops.aten._safe_softmax(scores, -1)
            ctx.save_for_backward(probabilities)
            ctx.input_dtype = scores.dtype
            return probabilities

        @staticmethod
        def backward(ctx, grad):
            (probabilities,) = ctx.saved_tensors
            scratch = torch.empty_like(grad)
            grad_scores = torch.ops.aten._softmax_backward_data(grad, probabilities, -1, ctx.input_dtype)
            del scratch
            return grad_scores

    return SafeSoftmax


def cuda_dropout(func, args, kwargs):
    """F.dropout / torch.dropout as CUDA runs them: the fused kernel, which saves a bool mask
    (other devices run a composite that saves a mask in the input's dtype)."""
    import torch

    named = dict(zip(("input", "p", "training", "inplace"), args))
    named.update(kwargs)
    tensor, p = named["input"], named.get("p", 0.5)
    training = named.get("training", named.get("train", True))
    if not training or named.get("inplace", False) or not 0 < p < 1 or not tensor.is_floating_point():
        return func(*args, **kwargs)
    return torch.native_dropout(tensor, p, True)[0]


def grouped_mm_stand_in(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """torch's grouped_mm in fp32/fp16, which CUDA runs but whose meta kernel accepts only bf16:
    the same output, saved tensors (both operands) and gradients, without computing anything."""
    return _grouped_mm_function().apply(mat_a, mat_b, offs)


@functools.cache
def _grouped_mm_function():
    import torch

    class GroupedMM(torch.autograd.Function):
        @staticmethod
        def forward(ctx, mat_a, mat_b, offs):
            ctx.save_for_backward(mat_a, mat_b)
            rows = mat_a.shape[0] if mat_a.dim() == 2 else mat_a.shape[:-1]
            shape = (rows, mat_b.shape[-1]) if mat_a.dim() == 2 else (*rows, mat_b.shape[-1])
            return mat_a.new_empty(shape)

        @staticmethod
        def backward(ctx, grad):
            mat_a, mat_b = ctx.saved_tensors
            return torch.empty_like(mat_a), torch.empty_like(mat_b), None

    return GroupedMM


# -- scratch memory of CUDA kernels (bytes allocated and freed inside one op) -----------------------

def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _flash_backward_workspace(args, kwargs, out):
    """FA2 mha_bwd: softmax_d and dq_accum in fp32, and dk/dv at q's head count for GQA."""
    query, key = args[1], args[2]
    batch, heads, seq_q, head_dim = query.shape
    kv_heads, seq_k = key.shape[1], key.shape[2]
    seq_q_rounded = _round_up(seq_q, 128)
    sizes = [batch * heads * seq_q_rounded * 4,
             batch * seq_q_rounded * heads * _round_up(head_dim, 32) * 4]
    if kv_heads != heads:
        sizes += [batch * seq_k * heads * head_dim * query.element_size()] * 2
    return sizes


def _efficient_backward_workspace(args, kwargs, out):
    """mem-efficient backward: delta (fp32, B*H*M) and an fp32 grad_q accumulator for 16-bit inputs."""
    query = args[1]
    batch, heads, seq_q, head_dim = query.shape
    sizes = [batch * heads * seq_q * 4]
    if query.element_size() < 4:
        sizes.append(batch * heads * seq_q * head_dim * 4)
    return sizes


def _cudnn_backward_workspace(args, kwargs, out):
    """cuDNN attention backward (a guess until measured): dQ accumulated in fp32 and the row sums."""
    query = args[1]
    batch, heads, seq_q, head_dim = query.shape
    return [batch * heads * seq_q * 4, batch * heads * seq_q * head_dim * 4]


def _safe_softmax_workspace(args, kwargs, out):
    """_safe_softmax (the math kernel's softmax): `self == -inf` as a bool mask of the input."""
    return [args[0].numel()]


def _embedding_backward_workspace(args, kwargs, out):
    """CUDA embedding_dense_backward: up to 3072 indices a direct kernel; beyond, a sort of the
    indices (sorted, original, their range, segment offsets, partial counts: int64 each) and the
    per-segment partial sums in fp32 (one row per distinct index, about one per token here)."""
    grad, indices = args[0], args[1]
    tokens = indices.numel()
    if tokens <= 3072:
        return []
    return [tokens * 8] * 6 + [tokens * grad.shape[-1] * 4]


def host_outputs() -> dict:
    """Outputs that the meta kernel makes but CUDA keeps on the host (not counted): the attention
    kernels' RNG seed and offset when there is no dropout ({op: fn(args, kwargs) -> indices})."""
    import torch

    aten = torch.ops.aten

    def rng_outputs(dropout_position, indices):
        def which(args, kwargs):
            dropout = args[dropout_position] if len(args) > dropout_position else kwargs.get("dropout_p", 0.0)
            return indices if not dropout else ()
        return which

    return {
        aten._scaled_dot_product_flash_attention.default: rng_outputs(3, (6, 7)),
        aten._scaled_dot_product_efficient_attention.default: rng_outputs(5, (2, 3)),
        aten._scaled_dot_product_cudnn_attention.default: rng_outputs(5, (6, 7)),
    }


def workspace_rules() -> dict:
    import torch

    aten = torch.ops.aten
    return {
        aten._scaled_dot_product_flash_attention_backward.default: _flash_backward_workspace,
        aten._scaled_dot_product_efficient_attention_backward.default: _efficient_backward_workspace,
        aten._scaled_dot_product_cudnn_attention_backward.default: _cudnn_backward_workspace,
        aten.embedding_dense_backward.default: _embedding_backward_workspace,
        aten._safe_softmax.default: _safe_softmax_workspace,
    }


# -- data-dependent values on the meta device -------------------------------------------------------

def scalar_stand_ins() -> dict:
    """`.item()` of a meta tensor answered from `UniformValues`, and fast _foreach_* ops."""
    import torch

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
        import torch

        if not isinstance(out, torch.Tensor) or out.device.type != "meta":
            return
        value = self._value(func, args, kwargs, out)
        if value is not None:
            out._simulated_value = _as_python(value, out.dtype)
        elif func._schema.is_mutable and hasattr(out, "_simulated_value"):
            del out._simulated_value  # written in place with values we do not know

    def _value(self, func, args, kwargs, out):
        import torch

        name = func._opname
        if name in self.CONSTRUCTORS:
            return self.CONSTRUCTORS[name]
        if name in self.FILLED:
            position = self.FILLED[name]
            return kwargs.get("fill_value", args[position] if len(args) > position else None)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        values = [getattr(t, "_simulated_value", None) for t in tensors]
        if not tensors or any(v is None for v in values):
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
    import torch

    if dtype == torch.bool:
        return bool(value)
    if dtype.is_floating_point:
        return float(value)
    return int(value)


def foreach_stand_ins() -> dict:
    """The optimizers' _foreach_* ops on meta tensors, without the slow per-tensor meta fallback:
    in-place ones allocate nothing, out-of-place ones one output like each input (as on CUDA)."""
    import torch

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


# -- the TorchFunctionMode ----------------------------------------------------------------------------

def _rules_class():
    import torch
    from torch.overrides import TorchFunctionMode

    class KernelRules(TorchFunctionMode):
        """CUDA's SDPA kernel choice and autocast, for tensors of `device_type`."""

        def __init__(self, device_type: str = "meta", sdpa: bool = True):
            super().__init__()
            self.device_type = device_type
            self.sdpa = sdpa
            self.autocast_dtype = None
            self.autocast_depth = 0
            self.cast_cache = {}

        @contextmanager
        def autocast(self, dtype=None, enabled: bool = True):
            """Like torch.autocast("cuda", dtype): casts by CUDA's op lists, weight casts cached."""
            previous = self.autocast_dtype
            self.autocast_dtype = (dtype or torch.bfloat16) if enabled else None
            self.autocast_depth += 1
            try:
                yield
            finally:
                self.autocast_depth -= 1
                self.autocast_dtype = previous
                if self.autocast_depth == 0:
                    self.cast_cache.clear()

        def state(self):
            return self.autocast_dtype

        def _eligible(self, t):
            return (isinstance(t, torch.Tensor) and t.device.type == self.device_type
                    and t.is_floating_point() and t.dtype != torch.float64)

        def _cast(self, t, dtype):
            if not self._eligible(t) or t.dtype == dtype:
                return t
            cacheable = (dtype == self.autocast_dtype and t.dtype == torch.float32 and t.requires_grad
                         and t.is_leaf and not t._is_view())
            if not cacheable:
                return t.to(dtype)
            hit = self.cast_cache.get(id(t))
            if hit is None or hit[0] is not t:
                hit = self.cast_cache[id(t)] = (t, t.to(dtype))
            return hit[1]

        def _cast_all(self, value, dtype):
            if isinstance(value, (list, tuple)):
                return type(value)(self._cast_all(v, dtype) for v in value)
            return self._cast(value, dtype)

        def _autocast_args(self, name, args, kwargs):
            if name in LOWER_PRECISION_OPS:
                dtype = self.autocast_dtype
            elif name in FP32_OPS:
                dtype = torch.float32
            elif name in FP32_SET_DTYPE_OPS:
                first = args[0] if args else None
                given = kwargs.get("dtype")
                for position in DTYPE_POSITION.get(name, ()):
                    if given is None and len(args) > position and isinstance(args[position], torch.dtype):
                        given = args[position]
                if given is None and self._eligible(first):
                    kwargs = dict(kwargs, dtype=torch.float32)
                return args, kwargs
            elif name in PROMOTE_OPS:
                floats = [t.dtype for t in args if self._eligible(t)]
                dtype = torch.float32 if torch.float32 in floats else None
                if dtype is None:
                    return args, kwargs
            else:
                return args, kwargs
            args = tuple(self._cast_all(a, dtype) for a in args)
            kwargs = {k: self._cast_all(v, dtype) for k, v in kwargs.items()}
            return args, kwargs

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = getattr(func, "__name__", None)
            if self.autocast_dtype is not None and name is not None:
                args, kwargs = self._autocast_args(name, args, kwargs)
            if self.sdpa and name == "scaled_dot_product_attention":
                return cuda_sdpa(*args, **kwargs)
            if self.sdpa and name == "dropout":
                return cuda_dropout(func, args, kwargs)
            if name in ("grouped_mm", "_grouped_mm") and args[0].dtype != torch.bfloat16 \
                    and args[0].device.type == "meta":
                return grouped_mm_stand_in(*args, **kwargs)
            return func(*args, **kwargs)

        def wrap_checkpointing(self, model) -> None:
            """Checkpointed layers recompute under the autocast state of their forward, as
            torch.utils.checkpoint does for CUDA (it cannot see this emulation on meta tensors)."""
            for module in model.modules():
                original = getattr(module, "_gradient_checkpointing_func", None)
                if original is None or getattr(original, "_simulated", False):
                    continue
                module._gradient_checkpointing_func = self._checkpoint_with_state(original)

        def _checkpoint_with_state(self, original):
            def checkpoint(function, *args, **kwargs):
                dtype = self.autocast_dtype

                def run(*inner_args, **inner_kwargs):
                    # the recompute runs inside backward, where no TorchFunctionMode is active
                    active = self in torch.overrides._get_current_function_mode_stack()
                    with (contextlib.nullcontext() if active else self), \
                            self.autocast(dtype, enabled=dtype is not None):
                        return function(*inner_args, **inner_kwargs)

                return original(run, *args, **kwargs)

            checkpoint._simulated = True
            return checkpoint

    return KernelRules


def make_kernel_rules(device_type: str = "meta", sdpa: bool = True):
    return _rules_class()(device_type, sdpa)
