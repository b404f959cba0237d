"""The simulator: the peak memory of the standard training step, predicted without a GPU and
without weights.

`simulate(config, run)` runs the real training step (transformers forward with labels, autograd backward,
torch.optim step) of the model built on the meta device, under a TorchDispatchMode that counts the
bytes of every storage from its creation until its last reference goes, rounded the way the CUDA
caching allocator counts them. Where CUDA behaves differently from the meta device (which attention
kernel runs and what it saves, autocast, kernel scratch memory) rules mirror CUDA.

Its folders are its layers (tests/test_layers.py): `memory/` (the live-byte tracker by role, the caching
allocator's replay, the output cache), `kernels/` (the kernel rules: autocast, SDPA, workspaces and scratch,
Triton wrappers' CUDA paths, bitsandbytes, the gradient scaler, autograd's accumulation) and `values/`
(data-dependent values without data), then the step and its installation (`trace`: any training code,
`pipeline.trace`; `step`; `predict`: the loop's loop_peak; `adapters`: LoRA / QLoRA on meta), `clients/` (the
real Trainer, SFTTrainer and DPOTrainer), `distributed/` (several GPUs: the fake process group, FSDP2 and
DDP, the clients under accelerate's preparation), and the entry points `api` (simulate), `peaks` (the
simulate-peaks stage) and `cli`.
Importing this package imports no torch.
"""

import os

# DeepSpeed, imported by the Trainer clients' libraries where it is installed, looks for an accelerator at import
# and prints a warning to stdout on a machine without a GPU (into an answer's JSON); the simulation runs it on
# an accelerator of its own (`distributed.zero`), so the choice is made here, before any import of it.
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from pipeline.simulate.cli import add_cli  # noqa: E402
from pipeline.simulate.peaks import SIMULATED_COLUMNS, simulate_peaks  # noqa: E402
from pipeline.simulate.api import simulate  # noqa: E402
from pipeline.simulate.predict import loop_peak  # noqa: E402

__all__ = ["SIMULATED_COLUMNS", "add_cli", "loop_peak", "simulate", "simulate_peaks"]
