"""What CUDA does differently from the meta device, as a TorchFunctionMode over the step.

The simulator runs the real transformers/PyTorch training step on meta tensors. Almost all of
its memory behaviour is device independent (same Python, same composite ops, same autograd
graph). What is not, and is mirrored here:

- scaled_dot_product_attention: which kernel CUDA picks and what that kernel saves for backward
  (`pipeline.simulate.kernels.sdpa`); the meta device itself would always run the math composite.
- autocast("cuda", bfloat16): the meta device has no autocast (`pipeline.training.autocast.CudaAutocast`,
  whose op lists and cache of weight casts this class inherits).
- dropout (CUDA's fused kernel) and grouped_mm in fp32 (`pipeline.simulate.kernels.cuda`).

Scratch memory of kernels, outputs kept on the host and data-dependent values are the dispatch
level's (`kernels.workspace_rules`, `kernels.host_outputs`, `stand_ins`), given to the tracker.
"""

from __future__ import annotations

import torch

from pipeline.training.autocast import CudaAutocast
from pipeline.simulate.kernels.cuda import cuda_dropout, grouped_mm_stand_in
from pipeline.simulate.kernels.sdpa import cuda_sdpa


class KernelRules(CudaAutocast):
    """CUDA's SDPA kernel choice, fused dropout and autocast, for tensors of `device_type`.

    `sdpa=False` leaves attention and dropout to the device's own kernels."""

    def __init__(self, device_type: str = "meta", sdpa: bool = True):
        super().__init__(device_type)
        self.sdpa = sdpa
        self.half_attention = False  # whether SDPA ran in 16 bits (CUDA loads its flash / efficient kernels)

    def call(self, func, name, args, kwargs):
        if name == "scaled_dot_product_attention":
            query = args[0] if args else kwargs.get("query")
            self.half_attention |= getattr(query, "dtype", None) in (torch.float16, torch.bfloat16)
            if self.sdpa:
                return cuda_sdpa(*args, **kwargs)
        if self.sdpa and name == "dropout":
            return cuda_dropout(func, args, kwargs)
        if name in ("grouped_mm", "_grouped_mm") and args[0].dtype != torch.bfloat16 \
                and args[0].device.type == "meta":
            return grouped_mm_stand_in(*args, **kwargs)
        return func(*args, **kwargs)
