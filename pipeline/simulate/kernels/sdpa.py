"""Scaled dot-product attention as CUDA runs it: which kernel the H200 build picks, what that
kernel saves for backward, and the scratch memory of its backward.

The meta device itself would always run the math composite; here the same aten kernel that CUDA
picks is called (its meta version returns the same outputs), or the math kernel op for op.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# Which kernels the H200 build picks; a table so that data can correct it.
SDPA_RULES = {
    "prefer_cudnn": True,  # cuDNN attention first: torch 2.11's cu130 build on sm90 picks it (allocator histories)
    "flash_max_head_dim": 256,
    "efficient_supports_gqa": False,  # True: mem-efficient takes k/v with fewer heads than q
}


def choose_sdpa_backend(query, key, value, attn_mask, dropout_p: float, enable_gqa: bool) -> str:
    """The kernel torch's CUDA select_sdp_backend picks on sm90: cudnn, flash, efficient or math."""
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
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask.logical_not(), float("-inf"))


def _pad_last_dim(tensor, alignment: int):
    """CUDA sdpa pads a head dim or mask width that is not a multiple of `alignment` (a copy)."""
    size = tensor.shape[-1]
    if size % alignment == 0:
        return tensor
    return F.pad(tensor, (0, alignment - size % alignment))


def cuda_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False):
    """F.scaled_dot_product_attention as CUDA runs it: the same kernel, hence the same saved tensors."""
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
    attn = SafeSoftmax.apply(attn)
    if dropout_p > 0.0:
        attn = torch.native_dropout(attn, dropout_p, True)[0]
    return torch.matmul(attn, value).to(origin_dtype)


class SafeSoftmax(torch.autograd.Function):
    """aten::_safe_softmax over the last dim, saving its output for a backward through
    `_softmax_backward_data`, whose CUDA kernel first computes grad * output into a temporary of the
    gradient's size (`kernels._softmax_backward_workspace`, as for eager attention's softmax). Its forward
    keeps a bool mask of the input alive (workspace rule)."""

    @staticmethod
    def forward(ctx, scores):
        probabilities = torch.ops.aten._safe_softmax(scores, -1)
        ctx.save_for_backward(probabilities)
        ctx.input_dtype = scores.dtype
        return probabilities

    @staticmethod
    def backward(ctx, grad):
        (probabilities,) = ctx.saved_tensors
        return torch.ops.aten._softmax_backward_data(grad, probabilities, -1, ctx.input_dtype)


# -- scratch memory of the attention backward kernels (bytes allocated and freed inside one op) ----

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
    """cuDNN attention backward: one workspace from the caching allocator (cuDNN's graph asks its size), measured
    on H100s (torch 2.11, cu130; allocator histories of results/edge*): two fp32 blocks of the query's size (dQ
    accumulated, and dK / dV accumulated at the query's heads), the fp32 row sums, and 256 bytes."""
    query = args[1]
    batch, heads, seq_q, head_dim = query.shape
    return [2 * batch * heads * seq_q * head_dim * 4 + batch * heads * seq_q * 4 + 256]


def _safe_softmax_workspace(args, kwargs, out):
    """_safe_softmax (the math kernel's softmax): `self == -inf` as a bool mask of the input."""
    return [args[0].numel()]


def attention_workspaces() -> dict:
    """{aten overload: fn(args, kwargs, out) -> [bytes, ...]} of the attention kernels."""
    aten = torch.ops.aten
    return {
        aten._scaled_dot_product_flash_attention_backward.default: _flash_backward_workspace,
        aten._scaled_dot_product_efficient_attention_backward.default: _efficient_backward_workspace,
        aten._scaled_dot_product_cudnn_attention_backward.default: _cudnn_backward_workspace,
        aten._safe_softmax.default: _safe_softmax_workspace,
    }


def attention_host_outputs() -> dict:
    """The attention kernels' RNG seed and offset, which the meta kernel makes but CUDA keeps on
    the host when there is no dropout ({op: fn(args, kwargs) -> output indices})."""
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
