"""amp-fp16's gradient scaler (`torch.amp.GradScaler`) on meta tensors.

The real GradScaler runs on the meta device (`GradScaler("meta")`): its tensors (scale, growth
tracker, inverse scale, found_inf and their per-device copies), the scaled loss and the in-place
unscale (`torch._amp_foreach_non_finite_check_and_unscale_`) and update (`torch._amp_update_scale_`)
have meta kernels, and allocate there what they allocate on CUDA. One thing a meta tensor cannot
answer: `scaler.step` asks `found_inf.item()` whether to skip the optimizer step. The stand-in below
answers "no inf": the step runs, as in the measured steps (their optimizer state exists) and in
training once the scale has settled.
"""

from __future__ import annotations


def scaler_stand_ins() -> dict:
    """{aten overload: fn(func, args, kwargs) -> out}: the unscale leaves found_inf at 0 on meta
    tensors, which `stand_ins.scalar_stand_ins`' `.item()` then reads."""
    import torch

    def unscale(func, args, kwargs):
        out = func(*args, **kwargs)
        found_inf = kwargs.get("found_inf", args[1] if len(args) > 1 else None)
        if isinstance(found_inf, torch.Tensor) and found_inf.device.type == "meta":
            found_inf._simulated_value = 0.0
        return out

    return {torch.ops.aten._amp_foreach_non_finite_check_and_unscale_.default: unscale}


def scaler_tensors(scaler) -> list:
    """The tensors a scaler keeps from its first `scale()` on (none without a scaler)."""
    if scaler is None:
        return []
    return [t for t in (scaler._scale, scaler._growth_tracker) if t is not None]
