"""The public functions: `estimate`, `max_batch_size`, `max_seq_len`, and `answer` (the JSON answer)."""

from __future__ import annotations

from pipeline.training.adapters import adapter_from_options
from pipeline.formulas.gpus import Device
from pipeline.estimate.estimators import ESTIMATORS, Estimator
from pipeline.estimate.search import largest_batch, largest_seq
from pipeline.core.errors import UserError
from pipeline.estimate.targets import resolve_target
from pipeline.estimate.training_args import read_training_args
from pipeline.training.values import GIB, Run, Target
from pipeline.estimate.verdict import judge, limited, required_device, gpu_of
from pipeline.core.vocabulary import METHODS, check_choice


def prepare(method, coefficients, model=None, config=None, params=None, active_params=None):
    """(estimator, target) for a method and what is estimated; one-line UserError for bad input."""
    check_choice("method", method, METHODS)
    target = resolve_target(model, config, params, method, active_params)
    return ESTIMATORS[method].load(coefficients), target


def make_run(batch=None, seq=None, precision=None, optimizer=None, checkpointing=None, attn_implementation=None,
             expandable_segments=False, client=None, optim=None, gradient_accumulation=None,
             training_args=None, num_gpus=1, sharding=None, adapter=None) -> tuple[Run, list]:
    """The Run of the user's options, and notes. `training_args` (a TrainingArguments JSON path or
    dict) sets the trainer client and what it names; an option given explicitly wins over it."""
    given = {"batch": batch, "precision": precision, "checkpointing": checkpointing, "client": client,
             "optim": optim, "gradient_accumulation": gradient_accumulation}
    notes = []
    if training_args is not None:
        from_file = read_training_args(training_args)
        notes = from_file.pop("notes")
        given = {key: from_file.get(key) if value is None else value for key, value in given.items()}
    if given["batch"] is None:
        raise UserError("the batch size is required: --batch (batch=), or per_device_train_batch_size in the "
                        "training arguments (or --max-batch-size)")
    if given["precision"] is None:
        raise UserError("the precision is required: --precision (precision=); training arguments set it only "
                        "with bf16 or fp16")
    if seq is None:
        raise UserError("the sequence length is required: --seq (seq=)")
    run = Run(given["batch"], seq, given["precision"], optimizer,
              False if given["checkpointing"] is None else given["checkpointing"], attn_implementation,
              expandable_segments, given["client"] or "loop", given["optim"],
              1 if given["gradient_accumulation"] is None else given["gradient_accumulation"], num_gpus, sharding,
              adapter)
    return run, [*notes, *(adapter.notes if adapter is not None else ())]


def estimate(model=None, config=None, params=None, *, batch=None, seq, precision=None, optimizer=None,
             checkpointing=None, method="heuristic", coefficients=None, gpu=None, gpu_memory_gib=None,
             attn_implementation=None, active_params=None, expandable_segments=False, client=None, optim=None,
             gradient_accumulation=None, training_args=None, num_gpus=1, sharding=None, lora_r=None,
             lora_alpha=None, lora_targets=None, quantization=None, peft_config=None) -> dict:
    """Peak memory of a training step at (batch, seq), with its components (bytes).

    Give one of `model` (registry or Hub id), `config` (config.json path, its dict, or a
    transformers config) or `params` (N; blog and heuristic only; with `active_params` for a MoE
    model, else it counts as dense). `coefficients` is a path or a loaded coefficient dict (default:
    results/coefficients.json). With `gpu` (a catalogue name, `pipeline.formulas.gpus.DEVICES`) or
    `gpu_memory_gib` (nvidia-smi's total in GiB) the answer says whether it fits ("fits",
    "headroom_bytes"), judged on the reserved bytes plus the memory outside PyTorch;
    `expandable_segments` replays PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.

    The step is the standard loop's (`client="loop"`, `optimizer` adamw or sgd) or
    transformers.Trainer's (`client="trainer"`, `optim` by its TrainingArguments name, default
    adamw_torch_fused, `gradient_accumulation` micro-batches per step); `training_args` (a
    TrainingArguments JSON path or dict) sets the trainer and what it names.

    LoRA: `lora_r` (rank), `lora_alpha` (default 2r), `lora_targets` ("all-linear" or module names
    joined by commas), `quantization` (nf4 | int8: QLoRA), or `peft_config` (an adapter_config.json).

    Several GPUs: `num_gpus` N and `sharding` ddp | fsdp | fsdp-no-reshard (FSDP2 per decoder layer
    and the root); `batch` is per GPU and the answer is one GPU's (rank 0), its fit verdict per GPU.
    """
    run, notes = make_run(batch, seq, precision, optimizer, checkpointing, attn_implementation, expandable_segments,
                          client, optim, gradient_accumulation, training_args, num_gpus, sharding,
                          adapter_from_options(lora_r, lora_alpha, lora_targets, quantization, peft_config))
    dev = gpu_of(gpu, gpu_memory_gib)
    estimator, target, run = for_device(method, coefficients, (model, config, params, active_params), run, dev)
    return with_notes(answer(estimator, target, run, dev), notes)


def for_device(method, coefficients, what: tuple, run: Run, dev: Device | None) -> tuple:
    """(estimator, target, run limited to what it may reserve on `dev`) for the public functions;
    `what` is (model, config, params, active_params)."""
    check_choice("method", method, METHODS)
    estimator, target = prepare(method, coefficients, *what)
    return estimator, target, limited(run, dev)


def with_notes(result: dict, notes: list) -> dict:
    if notes:
        result["notes"] = [*result.get("notes", []), *notes]
    return result


def answer(estimator: Estimator, target: Target, run: Run, dev: Device | None = None) -> dict:
    """The estimate as the JSON answer: what was estimated, the method's details, components, peak,
    reserved bytes and, for a device, the fit verdict."""
    estimated = estimator.predict(target, run)
    peak = estimated.peak_bytes
    result = {"method": estimator.name, "model_id": target.model_id, "parameters": target.parameters,
              "active_parameters": target.active, "parameters_source": target.source,
              "batch_size": run.batch, "seq_len": run.seq, "precision": run.precision, "client": run.client,
              "optimizer": run.optimizer, "optim": run.optim, "gradient_accumulation": run.gradient_accumulation,
              "num_gpus": run.num_gpus, "sharding": run.sharding,
              "adapter": None if run.adapter is None else run.adapter.columns(),
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


def max_batch_size(model=None, config=None, params=None, *, seq, precision=None, gpu=None, gpu_memory_gib=None,
                   optimizer=None, checkpointing=None, method="heuristic", coefficients=None,
                   attn_implementation=None, active_params=None, expandable_segments=False, client=None, optim=None,
                   gradient_accumulation=None, training_args=None, num_gpus=1, sharding=None, lora_r=None,
                   lora_alpha=None, lora_targets=None, quantization=None, peft_config=None) -> int:
    """The largest batch that fits the GPU at sequence length `seq` (0: none), by the fit verdict;
    the options are `estimate`'s."""
    run, _ = make_run(1, seq, precision, optimizer, checkpointing, attn_implementation, expandable_segments,
                      client, optim, gradient_accumulation, training_args, num_gpus, sharding,
                      adapter_from_options(lora_r, lora_alpha, lora_targets, quantization, peft_config))
    dev = required_device(gpu, gpu_memory_gib)
    return largest_batch(*for_device(method, coefficients, (model, config, params, active_params), run, dev), dev)


def max_seq_len(model=None, config=None, params=None, *, batch=None, precision=None, gpu=None, gpu_memory_gib=None,
                optimizer=None, checkpointing=None, method="heuristic", coefficients=None,
                attn_implementation=None, active_params=None, expandable_segments=False, client=None, optim=None,
                gradient_accumulation=None, training_args=None, num_gpus=1, sharding=None, lora_r=None,
                lora_alpha=None, lora_targets=None, quantization=None, peft_config=None) -> int:
    """The longest sequence that fits the GPU at batch size `batch` (0: none), by the fit verdict,
    at most the model's context length when its config gives one; the options are `estimate`'s."""
    run, _ = make_run(batch, 1, precision, optimizer, checkpointing, attn_implementation, expandable_segments,
                      client, optim, gradient_accumulation, training_args, num_gpus, sharding,
                      adapter_from_options(lora_r, lora_alpha, lora_targets, quantization, peft_config))
    dev = required_device(gpu, gpu_memory_gib)
    return largest_seq(*for_device(method, coefficients, (model, config, params, active_params), run, dev), dev)
