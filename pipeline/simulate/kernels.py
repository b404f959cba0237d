"""Other CUDA kernels whose memory differs from the meta device's: the cuBLAS workspaces, fused
dropout, grouped_mm in fp32, scratch memory allocated inside one op, and outputs kept on the host."""

from __future__ import annotations

import torch

from pipeline.simulate.sdpa import attention_host_outputs, attention_workspaces

# cuBLAS workspaces, allocated through the caching allocator on the first matmul of each thread
# (the forward's and the autograd engine's: 32 MiB each on sm90) plus 1 MiB (cuBLASLt), and kept:
# the sweep measures each point after earlier ones in the same process, so they are there from
# the start. Measured: pythia-14m's peaks exceed the simulation by 65 MiB in every phase, at
# every (B, L) and precision.
CUBLAS_WORKSPACES = (32 << 20, 32 << 20, 1 << 20)


def cuda_dropout(func, args, kwargs):
    """F.dropout / torch.dropout as CUDA runs them: the fused kernel, which saves a bool mask
    (other devices run a composite that saves a mask in the input's dtype)."""
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
    return GroupedMM.apply(mat_a, mat_b, offs)


class GroupedMM(torch.autograd.Function):
    """grouped_mm's output and gradients as empty tensors, saving both operands."""

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


def _embedding_backward_workspace(args, kwargs, out):
    """CUDA embedding_dense_backward: up to 3072 indices a direct kernel; beyond, a sort of the
    indices (sorted, original, their range, segment offsets, partial counts: int64 each) and the
    per-segment partial sums in fp32 (one row per distinct index, about one per token here)."""
    grad, indices = args[0], args[1]
    tokens = indices.numel()
    if tokens <= 3072:
        return []
    return [tokens * 8] * 6 + [tokens * grad.shape[-1] * 4]


def _bool_index_workspace(args, kwargs, out):
    """CUDA's `index` with a boolean mask first runs `nonzero` into a (count, mask dims) int64 tensor,
    freed after the op (TRL's fused LM head selects the labelled positions this way)."""
    rows = out.shape[0] if out.dim() else 0
    dims = sum(i.dim() for i in args[1] if i is not None and i.dtype in (torch.bool, torch.uint8))
    return [rows * dims * 8] if dims else []


def host_outputs() -> dict:
    """Outputs that the meta kernel makes but CUDA keeps on the host (not counted)."""
    return attention_host_outputs()


def workspace_rules() -> dict:
    """{aten overload: fn(args, kwargs, out) -> [bytes, ...]}: scratch memory of CUDA kernels."""
    from pipeline.simulate.bnb_kernels import bnb_workspace_rules

    return {**attention_workspaces(), torch.ops.aten.embedding_dense_backward.default: _embedding_backward_workspace,
            torch.ops.aten.index.Tensor: _bool_index_workspace, **bnb_workspace_rules()}
