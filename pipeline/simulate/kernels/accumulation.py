"""Autograd's accumulation of two gradients for one input, in place where CUDA's run does it.

When two backward paths reach the same tensor (a residual stream, a weight tied between the
embedding and the LM head), the engine sums their gradients in the consumer's input buffer
(torch/csrc/autograd/input_buffer.cpp, `accumulate`): `old_var.add_(var)` when it holds the last
reference to the first gradient and its storage (`can_accumulate_inplace`: not a view, dense,
use counts 1), else `old_var + var`, a new tensor. Under the simulator's TorchDispatchMode every
gradient has passed through Python, and the engine no longer sees itself as the last holder: it
always takes the out-of-place branch. Measured on an H100 (torch 2.11), a tied embedding under
amp-bf16: at the end of the backward 1.49 x (V x H x 4 bytes) above the start without a dispatch
mode, 2.50 x under a pass-through one, as in the simulator; in fp32 the LM head's gradient is a view
(of the transposed product) and both are out of place (3.0 x).

`accumulation_stand_ins` answers that `add` as the engine would natively: in place into the first
gradient when that one is stealable, judged from its storage's use count with the Python wrappers
of the dispatch call discounted. Adds inside a Python `autograd.Function`'s backward (a formula,
which CUDA also runs out of place) are left alone; so are adds outside a backward.
"""

from __future__ import annotations

import sys

# use count of a stealable gradient's storage as seen from the stand-in: the engine's own reference
# plus the Python storage object made to ask (calibrated on the CPU, where the same rule holds)
STEALABLE_STORAGE_USES = 2


def accumulation_stand_ins() -> dict:
    """{aten.add.Tensor: fn(func, args, kwargs) -> out} for the tracker's stand-ins."""
    import torch

    from pipeline.simulate.memory.output_cache import SHARED_OUTPUT_CACHE

    def add(func, args, kwargs):
        if engine_accumulation(args, kwargs):
            return args[0].add_(args[1])
        return SHARED_OUTPUT_CACHE.run(func, args, kwargs)  # as the tracker runs an op (meta tensors only)

    return {torch.ops.aten.add.Tensor: add}


def engine_accumulation(args, kwargs) -> bool:
    """Whether this `add` is the engine summing two gradients into a buffer it may steal."""
    import torch

    if torch.is_grad_enabled() or kwargs.get("alpha", 1) != 1 or len(args) != 2:
        return False
    old, new = args
    if not (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor)):
        return False
    if torch._C._current_graph_task_id() == -1:
        return False
    if old.shape != new.shape or old.dtype != new.dtype or old.device != new.device or old._is_view():
        return False
    if not old.is_contiguous() or old.is_sparse or type(old) is not torch.Tensor:
        return False
    if torch._C._storage_Use_Count(old.untyped_storage()._cdata) != STEALABLE_STORAGE_USES:
        return False
    return not in_python_function_backward()


def in_python_function_backward() -> bool:
    """Whether a Python `torch.autograd.Function.backward` is on the stack (its adds are formulas)."""
    import torch

    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "backward":
            owner = frame.f_locals.get("ctx")
            if isinstance(owner, torch.autograd.function.BackwardCFunction):
                return True
        frame = frame.f_back
    return False
