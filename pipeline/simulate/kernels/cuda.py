"""Other CUDA kernels whose memory differs from the meta device's: the cuBLAS workspaces, fused
dropout, grouped_mm in fp32, scratch memory allocated inside one op, and outputs kept on the host."""

from __future__ import annotations

import torch

from pipeline.simulate.kernels.sdpa import attention_host_outputs, attention_workspaces

# cuBLAS workspaces, allocated through the caching allocator on the first matmul of each thread
# (the forward's and the autograd engine's: 32 MiB each on sm90) plus 1 MiB (cuBLASLt), and kept:
# the sweep measures each point after earlier ones in the same process, so they are there from
# the start. Measured: pythia-14m's peaks exceed the simulation by 65 MiB in every phase, at
# every (B, L) and precision.
CUBLAS_WORKSPACE = 32 << 20
CUBLASLT_WORKSPACE = 1 << 20
CUBLAS_WORKSPACES = (CUBLAS_WORKSPACE, CUBLAS_WORKSPACE, CUBLASLT_WORKSPACE)


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


def _softmax_backward_workspace(args, kwargs, out):
    """CUDA's softmax backward (SoftMax.cu, softmax_backward_cuda_out) first computes `grad * output`
    into a temporary the size of the gradient, freed when the op returns: an eager attention's
    (B, H, L, L) fp32 buffer (measured: bloom-1b7 under SFTTrainer peaks exactly one such tensor above
    the meta kernels' count in the attention's backward). log_softmax's backward has no such step."""
    grad, output = args[0], args[1]
    return [grad.numel() * torch.promote_types(grad.dtype, output.dtype).itemsize]


def host_outputs() -> dict:
    """Outputs that the meta kernel makes but CUDA keeps on the host (not counted)."""
    return attention_host_outputs()


def workspace_rules() -> dict:
    """{aten overload: fn(args, kwargs, out) -> [bytes, ...]}: scratch memory of CUDA kernels."""
    from pipeline.simulate.kernels.bnb import bnb_workspace_rules
    from pipeline.simulate.kernels.reduce import reduction_workspaces

    return {**attention_workspaces(), torch.ops.aten.embedding_dense_backward.default: _embedding_backward_workspace,
            torch.ops.aten.index.Tensor: _bool_index_workspace,
            torch.ops.aten._softmax_backward_data.default: _softmax_backward_workspace, **bnb_workspace_rules(),
            **reduction_workspaces()}


class CublasWorkspaces:
    """The cuBLAS workspaces of the process, counted by `tracker` on `device_type` as activations.

    `warm`: an earlier step of the process made them (the sweep's points after its first): all three
    exist before the step, in the order CUBLAS_WORKSPACES lists them. Otherwise (a process's first
    step: a user's script) each is made where CUDA makes it, through the caching allocator, right
    after the outputs of the op that needs it: the first cuBLAS matmul of the forward gets the main
    thread's handle and its 32 MiB, the first of the backward the autograd engine thread's handle and
    its 32 MiB, and a thread's first cuBLASLt call (addmm with a bias vector: a linear layer with a
    bias) 1 MiB more. Made then, they take and split whatever cached block fits at that moment and
    keep it: measured on an H100 (LoRA, a process's first point), moving these three requests to the
    start of the step turns the real allocation history's reserved peak into the one of the sweep's
    later points, within 6 MiB.
    """

    def __init__(self, tracker, device_type: str, warm: bool):
        self.tracker, self.device_type = tracker, device_type
        self.made = {}  # (thread, library) -> the workspace tensor
        if warm:
            for key, size in zip((("forward", "cublas"), ("backward", "cublas"), ("forward", "cublaslt")),
                                 CUBLAS_WORKSPACES):
                self.made[key] = self._make(size)
        else:
            tracker.after_outputs = self.after

    def tensors(self, thread: str | None = None) -> list:
        """The workspaces made so far (of the forward's or the backward's thread)."""
        return [t for (made_by, _), t in self.made.items() if thread in (None, made_by)]

    def _make(self, size: int):
        workspace = torch.empty(size, dtype=torch.uint8, device=self.device_type)
        self.tracker.track(workspace, "activations")
        return workspace

    def after(self, func, args, kwargs) -> None:
        library = cublas_library(func, args, kwargs)
        if library is None or not any(isinstance(a, torch.Tensor) and a.device.type == self.device_type
                                      for a in args):
            return
        thread = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
        if (thread, "cublas") not in self.made:
            self.made[thread, "cublas"] = self._make(CUBLAS_WORKSPACE)
        if library == "cublaslt" and (thread, "cublaslt") not in self.made:
            self.made[thread, "cublaslt"] = self._make(CUBLASLT_WORKSPACE)


def cublas_library(func, args, kwargs) -> str | None:
    """Which cuBLAS interface CUDA's kernel of `func` calls: "cublaslt" (addmm with a bias vector, torch's
    Lt path with the bias epilogue), "cublas" (other matmuls; bitsandbytes' gemm_4bit where it falls
    back to dequantize + linear), or None."""
    name = getattr(func, "_opname", None)
    if name in ("addmm", "_addmm_activation"):
        bias = args[0]
        beta = kwargs.get("beta", args[3] if len(args) > 3 else 1)
        if name == "_addmm_activation" or (bias.dim() == 1 and beta == 1 and bias.is_contiguous()
                                            and bias.dtype in (torch.float32, torch.float16, torch.bfloat16)):
            return "cublaslt"
        return "cublas"
    if name in CUBLAS_OPS:
        return "cublas"
    if name == "gemm_4bit" and getattr(func, "namespace", None) == "bitsandbytes":
        from pipeline.simulate.kernels.bnb import gemm_4bit_workspace

        return "cublas" if gemm_4bit_workspace(args, kwargs, None) else None
    return None


# aten matmuls that CUDA runs through cuBLAS (their composite callers, linear and matmul, reach these)
CUBLAS_OPS = frozenset({"mm", "bmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "vdot", "_scaled_mm"})
