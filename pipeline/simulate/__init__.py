"""The simulator: the peak memory of the standard training step, predicted without a GPU and
without weights.

`simulate(config, run)` runs the real training step (transformers forward with labels, autograd backward,
torch.optim step) of the model built on the meta device, under a TorchDispatchMode that counts the
bytes of every storage from its creation until its last reference goes, rounded the way the CUDA
caching allocator counts them. Where CUDA behaves differently from the meta device (which attention
kernel runs and what it saves, autocast, kernel scratch memory) rules mirror CUDA.

Modules: `api` (simulate), `trace` (any training code under the simulator: `pipeline.trace`; the
clients' installation), `predict` (the loop's loop_peak, the meta model cache), `trainer` (trainer_peak),
`distributed` (distributed_peak), `step` (the step under the tracker),
`tracker` (live bytes by role), `allocator` (the caching allocator's blocks), `output_cache`,
`rules` (the TorchFunctionMode: autocast, SDPA, dropout), `sdpa`, `kernels` (workspaces, host
outputs, grouped_mm), `stand_ins` (data-dependent values), `scaler` (amp-fp16's gradient scaler),
`adapters` (LoRA / QLoRA: PEFT's wrapping on a meta model of their own, the 4-bit base on meta),
`bnb_kernels` (bitsandbytes' 4-bit matmul as CUDA runs it),
`peaks` (the simulate-peaks stage), `cli`.
Importing this package imports no torch.
"""

from pipeline.simulate.cli import add_cli
from pipeline.simulate.peaks import SIMULATED_COLUMNS, simulate_peaks
from pipeline.simulate.api import simulate
from pipeline.simulate.predict import loop_peak

__all__ = ["SIMULATED_COLUMNS", "add_cli", "loop_peak", "simulate", "simulate_peaks"]
