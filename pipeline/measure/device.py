"""One measuring process's device: set up once (seed, TF32, provenance columns), and whether CUDA
can be used without initialising it (so that the process stays fork-safe)."""

from __future__ import annotations

import os

from pipeline.core.errors import UserError

def setup_device(device: str, allow_tf32: bool) -> dict:
    """Initialise the device once per process; the columns that describe it (with provenance)."""
    import torch

    from pipeline.core.provenance import provenance

    torch.manual_seed(0)
    if device == "cuda":
        torch.cuda.init()
        torch.set_float32_matmul_precision("high" if allow_tf32 else "highest")
        total = torch.cuda.get_device_properties(0).total_memory
    else:
        total = None
    row = provenance()
    row.update(gpu_total_bytes=total, measure_device=device, allow_tf32=allow_tf32 if device == "cuda" else False)
    return row


def cuda_available() -> bool:
    """Whether CUDA can be used, asked through NVML so that this process stays fork-safe."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import torch

    return torch.cuda.is_available()


def cuda_device(device: str) -> str | None:
    """`auto` -> cuda when available, else None (the caller decides what no GPU means)."""
    if device == "auto":
        return "cuda" if cuda_available() else None
    if device == "cuda" and not cuda_available():
        raise UserError("--device cuda: no CUDA device is available here")
    return device
