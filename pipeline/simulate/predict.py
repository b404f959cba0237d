"""The loop's simulation, `loop_peak`: the peak memory of the standard training step on a GPU, without
a GPU and without weights (the model built on the meta device, once per config, precision and
attention), answered as the estimators' `Estimate`; and the parts every client's simulation shares.
"""

from __future__ import annotations

import functools
import json
import time

from pipeline.core.text import first_line
from pipeline.core.errors import UserError
from pipeline.inputs.configs import as_config
from pipeline.core.vocabulary import check_choice
from pipeline.training.values import Estimate, Run

# The simulator also takes "sdpa" (transformers' name for the default on current models).
ATTENTIONS = ("default", "sdpa", "eager")
# Fields of a simulation's result that an Estimate holds as its own (the rest are its details).
ESTIMATE_FIELDS = ("peak_bytes", "components", "peak_reserved_bytes", "peak_reserved_expandable_bytes")


def loop_peak(config, run: Run) -> Estimate:
    """The standard training step (or the blog's loop, `run.variant`) of `config` (a transformers
    config or a config.json dict) on meta tensors: `torch.cuda.max_memory_allocated()` (peak_bytes),
    its components (bytes by role at the peak), `max_memory_reserved()` (reserved_bytes; with
    `expandable_segments:True`: reserved_expandable_bytes) and, in `details`: phase_peaks, peak_phase,
    saved_bytes (autograd's saved-for-backward storages of the forward, parameters excluded),
    optimizer_state_bytes, reserve_limit_exceeded and seconds.

    `run.adapter` (LoRA / QLoRA) is run by PEFT's own wrapping on a meta model of its own
    (`pipeline.simulate.adapters`; `trainable_parameters` in details); `run.reserve_limit`: the bytes the
    process may reserve on its GPU, where the reserved replay gives cached segments back as the
    allocator does; `run.fresh_process`: the process's first step, whose cuBLAS workspaces are made at
    their first use inside the step (else before it, by an earlier point of the process).
    """
    from pipeline.simulate.step import simulate_training_step
    from pipeline.simulate.trace import Trace

    start = time.perf_counter()
    check_loop(run)
    config = as_config(config)
    trace = Trace("meta", reserve_limit=run.reserve_limit, warm=not run.fresh_process, automatic=False)
    model = run_model(config, run, trace)
    result = simulate_training_step(model, run.batch, run.seq, run.precision, run.optimizer, run.checkpointing,
                                    run.variant, trace=trace)
    if run.adapter is not None:
        from pipeline.training.adapters import trainable_parameters

        result["trainable_parameters"] = trainable_parameters(model)
    return estimate_of(result, start)


def run_model(config, run: Run, trace, anew: bool = False):
    """The meta model of `run` (with its adapters): for a process's first point (`run.fresh_process`)
    built in `trace` (`Trace.record`: the build's allocations, transient ones too, are the process's
    first, as on a GPU: a tied head's own weight made and dropped, PEFT's adapters made in the base's
    dtype and cast to fp32; a 4-bit base as from_pretrained loads its checkpoint); else the one cached per config, precision, attention and adapters, or a new one outside the trace
    (`anew`: for a client that changes the model it trains; `adapters.fresh_adapter_model`)."""
    from pipeline.simulate.adapters import (cached_adapter_model, check_adapter, fresh_adapter_model, fresh_base_model,
                                            loaded_from_checkpoint)
    from pipeline.training.adapters import apply_adapters

    attention = meta_attention(run.attn_implementation)
    if run.adapter is None:
        build, args = cached_meta_model, (config_key(config), run.precision, attention)
    else:
        check_adapter(run.adapter, run.variant)
        build, args = cached_adapter_model, (config_key(config), run.precision, attention, run.adapter,
                                             run.checkpointing)
    if run.fresh_process and run.adapter is not None and run.adapter.quantization:
        skeleton = fresh_base_model(*args[:3], run.adapter.quantization)  # loaded as from_pretrained loads it
        return trace.record(lambda: apply_adapters(loaded_from_checkpoint(skeleton, trace.tracker), run.adapter,
                                                   run.checkpointing))
    if run.fresh_process:
        return trace.record(lambda: build.__wrapped__(*args))
    return fresh_adapter_model(*args) if anew and run.adapter is not None else build(*args)


def estimate_of(result: dict, start: float) -> Estimate:
    """A simulation's result as the estimators' value: the peak, its components, the reserved bytes,
    and the rest (phase peaks, saved bytes, ...) with the seconds it took as details."""
    details = {k: v for k, v in result.items() if k not in ESTIMATE_FIELDS}
    details["seconds"] = time.perf_counter() - start
    return Estimate(float(result["peak_bytes"]), result.get("components"), details, result["peak_reserved_bytes"],
                    result["peak_reserved_expandable_bytes"])


def check_loop(run: Run) -> None:
    """What the loop simulator takes beyond a valid Run: an attention implementation it knows."""
    if run.attn_implementation is not None:
        check_choice("attn_implementation", run.attn_implementation, ATTENTIONS)


def meta_attention(attn_implementation):
    """The attention implementation to build with: None for the library's default."""
    return None if attn_implementation in (None, "default") else attn_implementation


def config_key(config) -> str:
    """A config as a hashable key of the meta model cache."""
    return json.dumps(config.to_dict(), sort_keys=True, default=str)


@functools.lru_cache(maxsize=4)
def cached_meta_model(config_json: str, precision: str, attn_implementation: str | None):
    """The model on the meta device (no weights), built once per (config, precision, attention)."""
    from pipeline.inputs.configs import config_from_dict
    from pipeline.inputs.modeling import build

    config = config_from_dict(json.loads(config_json))
    try:
        return build(config, precision, attn_implementation or "default", device="meta")
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - transformers rejects some configs / attention choices
        raise UserError(f"the model cannot be built from this config: {first_line(exc)}") from None
