"""A TorchFunctionMode applying CUDA's autocast policy (to bfloat16) to tensors of any device.

`torch.autocast` casts only tensors of its own device type, and meta tensors belong to none, so
autocast("cpu"/"cuda") leaves a meta forward in float32. `CudaAutocast` casts at the same op
boundaries as CUDA autocast (lists from the PyTorch AMP documentation), above autograd, so the
casts and what the ops save are recorded as on CUDA; casts of parameters are cached per forward
as autocast does. Imported by the counting code path only (torch).
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

LOWER = {"__matmul__", "addbmm", "addmm", "addmv", "addr", "baddbmm", "bmm", "chain_matmul", "multi_dot",
         "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
         "linear", "matmul", "mm", "mv", "prelu", "scaled_dot_product_attention"}
FP32 = {"__pow__", "__rdiv__", "__rpow__", "__rtruediv__", "acos", "asin", "binary_cross_entropy_with_logits",
        "cosh", "cosine_embedding_loss", "cdist", "cosine_similarity", "cross_entropy", "cumprod", "cumsum",
        "dist", "erfinv", "exp", "expm1", "group_norm", "hinge_embedding_loss", "kl_div", "l1_loss",
        "layer_norm", "log", "log_softmax", "log10", "log1p", "log2", "margin_ranking_loss", "mse_loss",
        "multilabel_margin_loss", "multi_margin_loss", "nll_loss", "norm", "normalize", "pdist",
        "poisson_nll_loss", "pow", "prod", "reciprocal", "rsqrt", "sinh", "smooth_l1_loss",
        "soft_margin_loss", "softmax", "softmin", "softplus", "sum", "renorm", "tan", "triplet_margin_loss",
        "rms_norm"}
PROMOTE = {"addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "grid_sample", "index_put",
           "scatter_add", "tensordot"}
FLOATING = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


class CudaAutocast(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.cast_cache = {}

    def cast(self, x, dtype):
        if not isinstance(x, torch.Tensor) or x.dtype not in FLOATING or x.dtype == dtype:
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
        if name in LOWER:
            args, kwargs = self.cast_all(args, kwargs, torch.bfloat16)
        elif name in FP32:
            args, kwargs = self.cast_all(args, kwargs, torch.float32)
        elif name in PROMOTE:
            widest = max((x.dtype for x in (*args, *kwargs.values())
                          if isinstance(x, torch.Tensor) and x.dtype in FLOATING),
                         key=lambda d: torch.finfo(d).bits, default=None)
            if widest is not None:
                args, kwargs = self.cast_all(args, kwargs, widest)
        return func(*args, **kwargs)
