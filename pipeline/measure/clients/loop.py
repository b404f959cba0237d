"""client = loop: the standard training step of pipeline.training.step, three times (amp-fp16 through a
gradient scaler: scaler.scale(loss).backward(); scaler.step(opt); scaler.update())."""

from __future__ import annotations

import time

from pipeline.measure.clients.tracking import PhaseTracker, optimizer_state_bytes
from pipeline.training.step import (STEPS, Setting, autocast, grad_scaler, make_optimizer, set_training_mode, token_ids,
                           trainable, training_loss, zero_grad)


def unavailable(setting: Setting, device: str) -> str | None:
    import importlib.util

    if setting.adapter is not None and importlib.util.find_spec("peft") is None:
        return "adapters need peft, which is not installed here"
    if setting.adapter is not None and setting.adapter.quantization and importlib.util.find_spec("bitsandbytes") is None:
        return f"quantization {setting.adapter.quantization} needs bitsandbytes, which is not installed here"
    return None


def run_steps(model, setting: Setting, precision: str, batch: int, seq: int, device: str,
              tracker: PhaseTracker, use_cache: bool, steps: int = STEPS, module=None):
    """The standard step, `steps` times; returns (seconds per step, optimizer-state bytes).
    `module`: what the step calls and optimizes when it is not the model itself (DDP's wrapper)."""
    import torch

    module = model if module is None else module
    set_training_mode(model, setting)
    optimizer = make_optimizer(trainable(module.parameters()), setting)  # the adapters' only on a frozen base
    scaler = grad_scaler(precision, device)
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        with tracker.phase("forward"):
            ids = token_ids(model, batch, seq, setting, device)
            with autocast(precision, device):
                loss = training_loss(module, ids, setting, use_cache)
        with tracker.phase("backward"):
            (loss if scaler is None else scaler.scale(loss)).backward()
        with tracker.phase("optimizer"):
            if scaler is None:
                optimizer.step()
            else:
                scaler.step(optimizer)
                scaler.update()
            zero_grad(optimizer, setting)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return seconds, optimizer_state_bytes(optimizer, device)
