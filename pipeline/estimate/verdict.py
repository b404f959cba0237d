"""The fit verdict: a step fits a device when its reserved bytes plus the memory outside PyTorch
(`pipeline.formulas.gpus`) are at most the device's nvidia-smi total."""

from __future__ import annotations

import math
import numbers
from dataclasses import replace

from pipeline.formulas.gpus import Device, Verdict, custom_device, device, outside_bytes
from pipeline.core.errors import UserError
from pipeline.core.text import short
from pipeline.training.values import GIB, Estimate, Run


def run_outside_bytes(run: Run, dev: Device) -> int:
    """The memory outside PyTorch of one of the run's processes on `dev` (NCCL's on several GPUs), and beside the
    training step's own allocations vLLM's pool where it generates on the same GPU (`vllm_pool_bytes`)."""
    return outside_bytes(dev, run.precision, run.attn_implementation, run.layout.communicators) + \
        vllm_pool_bytes(run, dev)


# vLLM's default share of the GPU in TRL's colocate mode (GRPOConfig.vllm_gpu_memory_utilization, trl 1.16)
VLLM_COLOCATE_SHARE = 0.3


def vllm_pool_bytes(run: Run, dev: Device) -> int:
    """GRPO / RLOO with `use_vllm` in colocate mode: vLLM in the training process takes `vllm_gpu_memory_utilization`
    of the GPU's total for itself (its weights, its profiled activations, and the KV cache blocks it sizes to fill
    the rest: vLLM's documented sizing), for the whole run (sleep mode, which gives it back between generations, is
    not modelled). Server mode: nothing on the training GPUs."""
    rollout = run.rollout
    if rollout is None or not rollout.use_vllm or (rollout.vllm_mode or "colocate") != "colocate":
        return 0
    share = rollout.vllm_gpu_memory_utilization or VLLM_COLOCATE_SHARE
    return int(share * dev.total_bytes)


def judge(estimated: Estimate, run: Run, dev: Device) -> Verdict:
    return Verdict(dev, estimated.reserved(run.expandable_segments), run_outside_bytes(run, dev),
                   estimated.reserved_expandable_bytes)


def limited(run: Run, dev: Device | None) -> Run:
    """The run with the bytes it may reserve on `dev` (its total less the memory outside PyTorch)."""
    if dev is None:
        return run
    return replace(run, reserve_limit=dev.total_bytes - run_outside_bytes(run, dev))


def gpu_of(gpu=None, gpu_memory_gib=None) -> Device | None:
    """The device of the fit verdict: a catalogue name or an nvidia-smi total in GiB (not both)."""
    if gpu is not None and gpu_memory_gib is not None:
        raise UserError("give one of gpu and gpu_memory_gib, not both")
    if gpu is not None:
        if not isinstance(gpu, str):
            raise UserError(f"gpu must be the name of a GPU of the catalogue (`estimate --help` lists them), "
                            f"not {short(gpu)}")
        return device(gpu)
    if gpu_memory_gib is not None:
        return custom_device(gpu_memory_bytes(gpu_memory_gib) / GIB)
    return None


def required_device(gpu, gpu_memory_gib) -> Device:
    dev = gpu_of(gpu, gpu_memory_gib)
    if dev is None:
        raise UserError("give the GPU: gpu (a name) or gpu_memory_gib")
    return dev


MAX_GPU_GIB = 1 << 16  # 64 TiB: far beyond any accelerator


def gpu_memory_bytes(gib) -> int:
    """A GPU's memory in GiB as bytes: a positive finite number (numpy's too; never a bool or text)
    of at most MAX_GPU_GIB."""
    if isinstance(gib, bool) or not isinstance(gib, numbers.Real):
        raise UserError(f"gpu memory must be a number of GiB, not {short(gib)}")
    value = float(gib)
    if not math.isfinite(value) or not 0 < value <= MAX_GPU_GIB:
        raise UserError(f"gpu memory {short(gib)} GiB must be positive and at most {MAX_GPU_GIB:,} GiB")
    return int(value * GIB)
