"""The public functions: `estimate`, `max_batch_size`, `max_seq_len`, and `answer` (the JSON answer)."""

from __future__ import annotations

from pipeline.devices import Device
from pipeline.estimate.estimators import ESTIMATORS, Estimator
from pipeline.estimate.search import largest_batch, largest_seq
from pipeline.estimate.targets import resolve_target
from pipeline.estimate.values import GIB, Run, Target
from pipeline.estimate.verdict import judge, required_device, resolve_device
from pipeline.vocabulary import METHODS, check_choice


def prepare(method, coefficients, model=None, config=None, params=None, active_params=None):
    """(estimator, target) for a method and what is estimated; one-line UserError for bad input."""
    check_choice("method", method, METHODS)
    target = resolve_target(model, config, params, method, active_params)
    return ESTIMATORS[method].load(coefficients), target


def estimate(model=None, config=None, params=None, *, batch, seq, precision, optimizer="adamw",
             checkpointing=False, method="heuristic", coefficients=None, gpu=None, gpu_memory_gib=None,
             attn_implementation=None, active_params=None, expandable_segments=False) -> dict:
    """Peak memory of the standard training step at (batch, seq), with its components (bytes).

    Give one of `model` (registry or Hub id), `config` (config.json path, its dict, or a
    transformers config) or `params` (N; blog and heuristic only; with `active_params` for a MoE
    model, else it counts as dense). `coefficients` is a path or a loaded coefficient dict (default:
    results/coefficients.json). With `gpu` (a catalogue name, `pipeline.devices.DEVICES`) or
    `gpu_memory_gib` (nvidia-smi's total in GiB) the answer says whether it fits ("fits",
    "headroom_bytes"), judged on the reserved bytes plus the memory outside PyTorch;
    `expandable_segments` replays PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.
    """
    run = Run(batch, seq, precision, optimizer, checkpointing, attn_implementation, expandable_segments)
    check_choice("method", method, METHODS)
    dev = resolve_device(gpu, gpu_memory_gib)
    estimator, target = prepare(method, coefficients, model, config, params, active_params)
    return answer(estimator, target, run, dev)


def answer(estimator: Estimator, target: Target, run: Run, dev: Device | None = None) -> dict:
    """The estimate as the JSON answer: what was estimated, the method's details, components, peak,
    reserved bytes and, for a device, the fit verdict."""
    estimated = estimator.predict(target, run)
    peak = estimated.peak_bytes
    result = {"method": estimator.name, "model_id": target.model_id, "parameters": target.parameters,
              "active_parameters": target.active, "parameters_source": target.source,
              "batch_size": run.batch, "seq_len": run.seq, "precision": run.precision, "optimizer": run.optimizer,
              "checkpointing": run.checkpointing, "expandable_segments": run.expandable_segments,
              **estimated.details, "components": estimated.components, "peak_formula": estimator.peak_formula,
              "peak_bytes": peak, "peak_gib": peak / GIB,
              "peak_reserved_bytes": estimated.reserved(run.expandable_segments)}
    if dev is not None:
        verdict = judge(estimated, run, dev)
        result.update(gpu=dev.name, device_total_bytes=dev.total_bytes, gpu_memory_bytes=dev.total_bytes,
                      outside_bytes=verdict.outside_bytes, fits=bool(verdict.fits),
                      headroom_bytes=verdict.headroom_bytes)
        if not run.expandable_segments:
            result["expandable_segments_would_fit"] = bool(verdict.expandable_fits)
            if verdict.expandable_fits and not verdict.fits:
                result.setdefault("notes", []).append(
                    "does not fit with the allocator's default settings, but fits with "
                    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (no segment fragmentation)")
    return result


def max_batch_size(model=None, config=None, params=None, *, seq, precision, gpu=None, gpu_memory_gib=None,
                   optimizer="adamw", checkpointing=False, method="heuristic", coefficients=None,
                   attn_implementation=None, active_params=None, expandable_segments=False) -> int:
    """The largest batch that fits the GPU at sequence length `seq` (0: none), by the fit verdict."""
    run = Run(1, seq, precision, optimizer, checkpointing, attn_implementation, expandable_segments)
    check_choice("method", method, METHODS)
    dev = required_device(gpu, gpu_memory_gib)
    estimator, target = prepare(method, coefficients, model, config, params, active_params)
    return largest_batch(estimator, target, run, dev)


def max_seq_len(model=None, config=None, params=None, *, batch, precision, gpu=None, gpu_memory_gib=None,
                optimizer="adamw", checkpointing=False, method="heuristic", coefficients=None,
                attn_implementation=None, active_params=None, expandable_segments=False) -> int:
    """The longest sequence that fits the GPU at batch size `batch` (0: none), by the fit verdict,
    at most the model's context length when its config gives one."""
    run = Run(batch, 1, precision, optimizer, checkpointing, attn_implementation, expandable_segments)
    check_choice("method", method, METHODS)
    dev = required_device(gpu, gpu_memory_gib)
    estimator, target = prepare(method, coefficients, model, config, params, active_params)
    return largest_seq(estimator, target, run, dev)
