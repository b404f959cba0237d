"""Liger's kernels (`liger_kernel`: `use_liger_kernel=True` of TrainingArguments and SFTConfig;
liger-kernel 0.8), for the measurement on a GPU and the simulator alike.

`Trainer.train()` calls `transformers.integrations.liger.apply_liger_kernel(model, liger_kernel_config)`,
which runs the model type's `apply_liger_kernel_to_*` of liger-kernel: it rebinds process-wide names
(the modeling module's RMSNorm and MLP classes and `apply_rotary_pos_emb`; for some types
`torch.nn.functional.cross_entropy`) and patches the model's own modules (their `forward` bound to
Liger's, attributes such as `casting_mode`), and, in the plain Trainer, replaces the model's forward
with the fused linear cross-entropy (`lce_forward`). SFTTrainer turns that last one off
(`SFT_LIGER_CONFIG`): its own fused LM head scores the labels.

Left in place, the rebound names give every later model of the process Liger's kernels.
`LigerPatches` records all of it before and puts it back after (`with LigerPatches(model): ...`).
"""

from __future__ import annotations

import sys

# SFTTrainer's liger_kernel_config (trl 1.16): Liger's layer kernels without its fused linear cross-entropy
SFT_LIGER_CONFIG = {"fused_linear_cross_entropy": False}


def liger_unavailable(device: str | None = None) -> str | None:
    """Why Liger's kernels cannot run here (liger-kernel or Triton missing; for a measurement on
    `device`, no CUDA: Triton launches its kernels on a GPU), or None."""
    import importlib.util

    if device is not None and device != "cuda":
        return f"liger_kernel runs Triton kernels, which need a CUDA device, not {device}"
    for package in ("liger_kernel", "triton"):
        if importlib.util.find_spec(package) is None:
            return f"liger_kernel needs {package.replace('_', '-')}, which is not installed here"
    return None


# liger-kernel's dispatcher ops that the patched models call (liger_kernel.functional declares them)
LIGER_OPS = ("rms_norm", "layer_norm", "swiglu", "geglu", "rope", "softmax", "cross_entropy",
             "cross_entropy_loss_and_grad", "fused_add_rms_norm", "fused_linear_cross_entropy")


def import_liger() -> None:
    """Import Liger's patching code and let its dispatcher look for every op's backends now: its first
    call otherwise imports them in the middle of a step, and an optional backend that fails to import
    is logged with the exception, whose traceback keeps that step's tensors alive wherever the log
    record is kept (a test's log capture)."""
    import liger_kernel.functional  # noqa: F401 - declares the ops
    import liger_kernel.transformers.monkey_patch  # noqa: F401
    from liger_kernel.backends.registry import list_registered

    for op in LIGER_OPS:
        list_registered(op)


def _patched_modules() -> list:
    """The modules whose globals Liger may rebind: transformers' modeling modules and torch.nn.functional."""
    import torch.nn.functional

    names = [name for name in sys.modules if name.startswith("transformers.models.") or name == "transformers.loss.loss_utils"]
    return [sys.modules[name] for name in names] + [torch.nn.functional]


class LigerPatches:
    """Records the process-wide names and the model's module attributes that Liger may rebind, and
    puts them back on exit (whatever ran in between: `Trainer.train()` applying Liger, or
    `apply_liger_kernel` itself). Module attributes are restored shallowly: entries added to a
    module's `__dict__` go, entries that changed get their old value (the model's forward wrappers
    of accelerate and TRL included)."""

    def __init__(self, model):
        self.model = model
        self.globals = []
        self.instances = []

    def __enter__(self) -> LigerPatches:
        self.globals = [(module, dict(vars(module))) for module in _patched_modules()]
        self.instances = [(module, dict(module.__dict__)) for module in self.model.modules()]
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def restore(self) -> None:
        for module, saved in self.globals:
            namespace = vars(module)
            for key, value in saved.items():
                if namespace.get(key) is not value:
                    setattr(module, key, value)
        for module, saved in self.instances:
            for key in [k for k in module.__dict__ if k not in saved]:
                del module.__dict__[key]
            for key, value in saved.items():
                if module.__dict__.get(key) is not value:
                    module.__dict__[key] = value
        self.globals, self.instances = [], []
