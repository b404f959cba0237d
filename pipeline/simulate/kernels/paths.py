"""CUDA's code paths of the Python wrappers around Triton kernels (TRL's fused LM head, Liger's
kernels), taken on meta tensors (and on the CPU of the reference runs), with the Triton launches as
no-ops. `cuda_paths(rules, trl=..., liger=...)` is the context of a Trainer client's simulated run.

- A Triton kernel writes only into buffers its Python wrapper allocated, so on meta a launch is a
  no-op (`KernelInterface.__getitem__`); on the CPU of a reference run TRL's fold kernels run their
  torch fallbacks outside the tracker (the values are right, nothing is counted, as for one CUDA
  kernel), and other kernels (Liger's) are no-ops there too: their values reach no memory decision.
- TRL's fused LM head (`trl.kernels.chunked_logprob`, trl 1.16) takes CUDA's path on any device
  (`_use_triton` true): the compact branch that scores only the labelled positions, the fold kernels
  instead of the torch fallbacks (`_forward_tile` allocates (n, chunk) fp32 temporaries that the
  Triton kernel does not), and `_addmm_fp32`'s `torch.addmm(out_dtype=float32, out=acc)` instead of
  `acc.addmm_(a.float(), b.float())`. `torch.is_autocast_enabled` / `get_autocast_dtype` inside it
  (and inside Liger's wrappers) answer the emulated CUDA autocast of `KernelRules`, so its compute
  dtype is bf16 as on CUDA.
- Liger (liger-kernel 0.8.5): its wrappers' CUDA-only branches are taken (`cuda_view` recompiles a
  function with `device.type == "cuda"` true and an H100's device properties): `rms_norm_backward`'s
  per-SM fp32 partial dW is (132, H) as on an H100, not (1, H); the fused linear cross-entropy (the
  plain Trainer's) reuses one logits buffer (`_can_use_mm_out`) and accumulates dW with
  `addmm(out=...)` instead of `grad_weight += mm(...).float()`.
"""

from __future__ import annotations

import contextlib
import types

import torch

H100_SMS = 132  # streaming multiprocessors of an H100 SXM (Liger sizes per-SM buffers by them)

# (module, function): {source text: its CUDA branch}; each text must occur (else another liger-kernel version)
LIGER_CUDA_BRANCHES = {
    ("liger_kernel.ops.rms_norm", "rms_norm_backward"): {
        'if X.device.type == "cuda":': 'if X.device.type in ("cuda", "meta", "cpu"):',
        "sm_count = torch.cuda.get_device_properties(X.device).multi_processor_count": f"sm_count = {H100_SMS}"},
    ("liger_kernel.ops.fused_linear_cross_entropy", "_can_use_mm_out"): {
        '_input.device.type != "cuda"': '_input.device.type not in ("cuda", "meta", "cpu")'},
    ("liger_kernel.ops.fused_linear_cross_entropy", "fused_linear_cross_entropy_forward"): {
        'grad_weight.device.type == "cuda"': 'grad_weight.device.type in ("cuda", "meta", "cpu")',
        "torch.cuda.get_device_capability(grad_weight.device)[0] >= 8": "True"},
}


class AutocastTorch(types.ModuleType):
    """`torch` as a kernel wrapper sees it: autocast questions about CUDA (or the simulated device, or
    the default device) answered by the emulation `rules` (`KernelRules`)."""

    def __init__(self, rules):
        super().__init__("torch")
        self._rules = rules

    def __getattr__(self, name):
        return getattr(torch, name)

    def _simulated(self, device_type) -> bool:
        return device_type in (None, "cuda", self._rules.device_type)

    def is_autocast_enabled(self, device_type=None):
        if self._simulated(device_type):
            return self._rules.autocast_dtype is not None
        return torch.is_autocast_enabled(device_type)

    def get_autocast_dtype(self, device_type):
        if self._simulated(device_type) and self._rules.autocast_dtype is not None:
            return self._rules.autocast_dtype
        return torch.get_autocast_dtype(device_type)


def cuda_view(module, name: str, substitutions: dict, namespace: dict | None = None):
    """`module.name` recompiled from its source with `substitutions` (each must occur): the CUDA branches
    of code that asks `tensor.device.type == "cuda"` or queries the device, taken on meta or CPU tensors."""
    import inspect
    import textwrap

    from pipeline.core.errors import UserError

    source = textwrap.dedent(inspect.getsource(getattr(module, name)))
    for old, new in substitutions.items():
        if old not in source:
            raise UserError(f"{module.__name__}.{name}: {old!r} not found: the simulator knows liger-kernel 0.8.5")
        source = source.replace(old, new)
    scope = dict(vars(module), **(namespace or {}))
    exec(compile(source, f"<cuda view of {module.__name__}.{name}>", "exec"), scope)  # noqa: S102 - the package's own source
    return scope[name]


def _triton_launches(fallbacks: dict):
    """`KernelInterface.__getitem__` whose launches on meta or CPU tensors allocate nothing (CPU: the
    torch fallback of `fallbacks` runs outside the tracker, where one exists)."""
    from torch.utils._python_dispatch import _disable_current_modes
    from triton.runtime.jit import KernelInterface

    original = KernelInterface.__getitem__

    def getitem(kernel, grid):
        launch = original(kernel, grid)

        def run(*args, **kwargs):
            tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
            if any(t.device.type in ("meta", "cpu") for t in tensors):
                fallback = fallbacks.get(getattr(kernel, "fn", None))
                if fallback is not None and tensors[0].device.type == "cpu":
                    with _disable_current_modes(), torch.no_grad():
                        fallback(*args, **{k: v for k, v in kwargs.items() if k != "num_warps"})
                return None
            return launch(*args, **kwargs)

        return run

    return KernelInterface, "__getitem__", getitem


def _trl_paths(rules) -> list:
    """(owner, name, replacement) of TRL's fused head taking CUDA's path."""
    import trl.kernels.chunked_logprob as chunked
    import trl.trainer.utils as trl_utils
    from torch.utils._python_dispatch import _disable_current_modes

    def addmm_fp32(acc, a, b):
        if acc.device.type == "meta" and a.dtype in (torch.float16, torch.bfloat16):
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)  # CUDA's branch
        elif acc.device.type == "cpu":
            with _disable_current_modes():  # CUDA computes this in one kernel, without temporaries
                acc.addmm_(a.float(), b.float())
        else:
            acc.addmm_(a.float(), b.float())

    def on_triton_device(device) -> bool:
        return True

    return [(chunked, "_use_triton", on_triton_device), (trl_utils, "_use_triton", on_triton_device),
            (chunked, "_addmm_fp32", addmm_fp32), (chunked, "torch", AutocastTorch(rules))]


def _liger_paths(rules) -> list:
    import importlib

    replacements = []
    for (module_name, name), substitutions in LIGER_CUDA_BRANCHES.items():
        module = importlib.import_module(module_name)
        replacements.append((module, name, cuda_view(module, name, substitutions, {"torch": AutocastTorch(rules)})))
    return replacements


def out_dtype_addmm_stand_ins() -> dict:
    """`torch.addmm(acc, a, b, out_dtype=float32, out=acc)` (16-bit inputs accumulated into fp32 in one
    CUDA kernel, Liger's dW branch) on a CPU reference run: the same sum computed outside the tracker
    (the CPU has no kernel for it); on meta the op's meta kernel runs (it allocates nothing)."""
    from torch.utils._python_dispatch import _disable_current_modes

    def addmm_out_dtype(func, args, kwargs):
        named = dict(zip(("self", "mat1", "mat2", "out_dtype"), args), **kwargs)
        out = named["out"]
        if out.device.type != "cpu":
            return func(*args, **kwargs)
        with _disable_current_modes():
            out.mul_(named.get("beta", 1)).addmm_(named["mat1"].float(), named["mat2"].float(),
                                                   alpha=named.get("alpha", 1))
        return out

    return {torch.ops.aten.addmm.dtype_out: addmm_out_dtype}


def trl_fallbacks() -> dict:
    """TRL's Triton fold kernels and their torch fallbacks (the CPU reference run's values)."""
    import trl.kernels.chunked_logprob as chunked

    return {chunked._forward_kernel.fn: chunked._forward_tile, chunked._backward_kernel.fn: chunked._backward_tile}


@contextlib.contextmanager
def cuda_paths(rules, trl: bool = False, liger: bool = False):
    """The stand-ins above for one simulated run: TRL's fused head (`trl`), Liger's wrappers (`liger`),
    Triton launches as no-ops (either)."""
    if not (trl or liger):
        yield
        return
    replacements = [_triton_launches(trl_fallbacks() if trl else {})]
    replacements += _trl_paths(rules) if trl else []
    replacements += _liger_paths(rules) if liger else []
    saved = []
    try:
        for owner, name, value in replacements:
            saved.append((owner, name, getattr(owner, name)))
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)
