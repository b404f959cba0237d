"""The simulator: the peak memory of the standard training step, predicted without a GPU and
without weights.

`predict_peak` runs the real training step (transformers forward with labels, autograd backward,
torch.optim step) of the model built on the meta device, under a TorchDispatchMode that counts the
bytes of every storage from its creation until its last reference goes, rounded the way the CUDA
caching allocator counts them. Where CUDA behaves differently from the meta device (which attention
kernel runs and what it saves, autocast, kernel scratch memory) rules mirror CUDA.

Modules: `predict` (predict_peak, the meta model cache), `step` (the step under the tracker),
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
from pipeline.simulate.predict import cached_meta_model, check_inputs, predict_peak
from pipeline.simulate.step import simulate_training_step

__all__ = ["SIMULATED_COLUMNS", "add_cli", "cached_meta_model", "check_inputs", "predict_peak", "simulate_peaks",
           "simulate_training_step"]
