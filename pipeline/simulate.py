"""Stage: the peak memory of the standard training step, simulated without a GPU and without weights.

`predict_peak` runs the real training step (transformers forward with labels, autograd backward,
torch.optim step) of the model built on the meta device, under a TorchDispatchMode that counts the
bytes of every storage from its creation until its last reference goes, rounded the way the CUDA
caching allocator counts them (`pipeline.simulate_tracker`). Where CUDA behaves differently from
the meta device (which attention kernel runs and what it saves, autocast, kernel scratch memory)
the rules in `pipeline.simulate_rules` mirror CUDA.

The loop is DESIGN.md's (and `pipeline.memory`'s): a peak per phase (forward, backward, optimizer),
the maximum over three steps. Steps 2 and 3 are alike: they differ from step 1 by the optimizer
state that exists from step 1 on (and the previous step's loss). So one forward and backward is
run, then two optimizer steps: forward and backward peaks of step 2 are those of step 1 plus the
state; the optimizer peak is the larger of the two optimizer steps.
"""

from __future__ import annotations

import functools
import json
import time

from pipeline.errors import UserError

PRECISIONS = ("fp32", "bf16", "amp-bf16")
OPTIMIZERS = ("adamw", "sgd")
VARIANTS = ("standard", "blog")
ATTENTIONS = (None, "default", "sdpa", "eager")
BLOG_ID_RANGE = 100
PHASES = ("forward", "backward", "optimizer")


# ----------------------------------------------------------------------------- public API


def predict_peak(config, batch_size: int, seq_len: int, precision: str = "fp32", optimizer: str = "adamw",
                 gradient_checkpointing: bool = False, attn_implementation: str | None = None,
                 variant: str = "standard") -> dict:
    """Predicted `torch.cuda.max_memory_allocated()` of the standard training step on an H200.

    `config`: a transformers config or a config.json dict. Returns peak_bytes, components (bytes by
    role at the peak moment), phase_peaks, saved_bytes (autograd saved-for-backward storages of the
    forward, parameters excluded) and seconds.
    """
    start = time.perf_counter()
    check_inputs(batch_size, seq_len, precision, optimizer, gradient_checkpointing, attn_implementation, variant)
    config = _as_config(config)
    model = cached_meta_model(_config_key(config), precision, _attention(attn_implementation))
    result = simulate_training_step(model, batch_size, seq_len, precision, optimizer, gradient_checkpointing,
                                    variant, device_type="meta")
    result["seconds"] = time.perf_counter() - start
    return result


def check_inputs(batch_size, seq_len, precision, optimizer, gradient_checkpointing, attn_implementation,
                 variant) -> None:
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise UserError(f"{name} must be a positive integer, not {value!r}")
    for name, value, allowed in (("precision", precision, PRECISIONS), ("optimizer", optimizer, OPTIMIZERS),
                                 ("variant", variant, VARIANTS),
                                 ("attn_implementation", attn_implementation, ATTENTIONS)):
        if value not in allowed:
            shown = ", ".join(str(a) for a in allowed if a is not None)
            raise UserError(f"{name} {value!r} is not one of {shown}")
    if not isinstance(gradient_checkpointing, bool):
        raise UserError(f"gradient_checkpointing must be true or false, not {gradient_checkpointing!r}")


def _attention(attn_implementation):
    return None if attn_implementation in (None, "default") else attn_implementation


def _as_config(config):
    from pipeline.configs import config_from_dict

    if isinstance(config, dict):
        return config_from_dict(config)
    if not hasattr(config, "to_dict") or not getattr(config, "model_type", None):
        raise UserError(f"config must be a transformers config or a config.json dict, not {type(config).__name__}")
    return config


def _config_key(config) -> str:
    return json.dumps(config.to_dict(), sort_keys=True, default=str)


@functools.lru_cache(maxsize=4)
def cached_meta_model(config_json: str, precision: str, attn_implementation: str | None):
    """The model on the meta device (no weights), built once per (config, precision, attention)."""
    from pipeline.configs import config_from_dict
    from pipeline.modeling import build

    config = config_from_dict(json.loads(config_json))
    try:
        return build(config, precision, attn_implementation or "default", device="meta")
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - transformers rejects some configs / attention choices
        raise UserError(f"the model cannot be built from this config: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"[:300]


# ----------------------------------------------------------------------------- the step


def simulate_training_step(model, batch_size: int, seq_len: int, precision: str = "fp32", optimizer: str = "adamw",
                           gradient_checkpointing: bool = False, variant: str = "standard",
                           device_type: str = "meta", cuda_rules: bool = True, blocks: bool = True) -> dict:
    """Run the training step of `model` (on `device_type`) under the live-byte tracker.

    `device_type="cpu"` with real weights runs the same step for real (the tests compare both).
    `cuda_rules=False` leaves SDPA to the device's own choice. `blocks=False` counts requests
    rounded to 512 bytes instead of the caching allocator's blocks.
    """
    import torch

    from pipeline.simulate_rules import (CUBLAS_WORKSPACES, UniformValues, host_outputs, make_kernel_rules,
                                         scalar_stand_ins, workspace_rules)
    from pipeline.simulate_tracker import allocated_bytes, make_tracker

    rules = make_kernel_rules(device_type, sdpa=cuda_rules)
    from pipeline.simulate_allocator import CachingAllocator

    meta = device_type == "meta"
    tracker = make_tracker(device_type, workspace_rules() if cuda_rules else None,
                           scalar_stand_ins() if meta else None, UniformValues() if meta else None,
                           CachingAllocator() if blocks else None, host_outputs() if cuda_rules else None)
    _apply_setting(model, variant, gradient_checkpointing, rules)
    params = list(model.parameters())
    for tensor in params + list(model.buffers()):
        tracker.track(tensor, "parameters")
    workspaces = [torch.empty(size, dtype=torch.uint8, device=device_type) for size in CUBLAS_WORKSPACES]
    for workspace in workspaces if cuda_rules else ():
        tracker.track(workspace, "activations")
    hooks = [p.register_post_accumulate_grad_hook(lambda p: tracker.retag(p.grad, "gradients"))
             for p in params if p.requires_grad]
    opt = make_optimizer(params, optimizer, variant)
    saved = SavedTensors(params)
    try:
        with rules, tracker:
            tracker.start_phase("forward", "activations")
            ids = _token_ids(model, batch_size, seq_len, variant, device_type)
            with saved.hooks(), (rules.autocast(torch.bfloat16) if precision == "amp-bf16" else _nothing()):
                loss = _loss(model, ids, variant)
            saved_bytes = saved.bytes()
            tracker.observer = None  # data-dependent questions are asked in the forward only
            tracker.start_phase("backward", "activations")
            loss.backward()
            tracker.start_phase("optimizer", "optimizer_intermediates")
            opt.step()
            state = _optimizer_state(opt, device_type)
            for tensor in state:
                tracker.retag(tensor, "optimizer_state")
            step1 = tracker.peaks.pop("optimizer")
            tracker.start_phase("optimizer", "optimizer_intermediates")
            opt.step()
            opt.zero_grad(set_to_none=True)
            tracker.phase = None
    finally:
        for hook in hooks:
            hook.remove()
        model.zero_grad(set_to_none=True)
    state_bytes = tracker.bytes_of(state)
    state_raw_bytes = sum({id(t.untyped_storage()): t.untyped_storage().nbytes() for t in state
                           if tracker.bytes_of([t])}.values())  # not AdamW's step counters (host scalars)
    loss_bytes = allocated_bytes(loss.untyped_storage().nbytes()) if loss.device.type == device_type else 0
    result = _summarise(tracker.peaks, step1, state_bytes, loss_bytes, saved_bytes)
    result["optimizer_state_bytes"] = state_raw_bytes  # as pipeline.memory reports it: storage bytes
    return result


def _summarise(peaks, optimizer_step1, state_bytes, loss_bytes, saved_bytes) -> dict:
    """Phase peaks over the three steps, and the components at the overall peak."""
    later = {"forward": state_bytes + loss_bytes, "backward": state_bytes, "optimizer": 0}
    if optimizer_step1.total > peaks["optimizer"].total:
        peaks["optimizer"] = optimizer_step1
    phase_peaks, parts = {}, {}
    for phase in PHASES:
        snap = peaks[phase]
        phase_peaks[phase] = snap.total + later[phase]
        parts[phase] = dict(snap.parts)
        parts[phase]["optimizer_state"] += state_bytes if later[phase] else 0
        parts[phase]["activations"] += later[phase] - (state_bytes if later[phase] else 0)
    top = max(PHASES, key=lambda p: phase_peaks[p])
    return {"peak_bytes": phase_peaks[top], "components": parts[top], "peak_phase": top,
            "phase_peaks": phase_peaks, "saved_bytes": saved_bytes, "optimizer_state_bytes": state_bytes}


class SavedTensors:
    """Distinct storages that autograd saves during the forward (parameters excluded), raw bytes."""

    def __init__(self, params):
        self.params = {id(p.untyped_storage()) for p in params}
        self.storages = {}

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        if id(storage) not in self.params:
            self.storages[id(storage)] = storage.nbytes()
        return tensor

    def hooks(self):
        import torch

        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor)

    def bytes(self) -> int:
        return sum(self.storages.values())


def _nothing():
    import contextlib

    return contextlib.nullcontext()


def _apply_setting(model, variant: str, gradient_checkpointing: bool, rules) -> None:
    """As pipeline.memory.apply_setting: the blog's loop runs in eval mode."""
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
        rules.wrap_checkpointing(model)
    elif getattr(model, "is_gradient_checkpointing", False):
        model.gradient_checkpointing_disable()
    model.train(variant != "blog")


def make_optimizer(params, optimizer: str, variant: str):
    """As pipeline.memory.make_optimizer, with the implementation CUDA defaults to (foreach)."""
    import torch

    if optimizer == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=True)
    return torch.optim.AdamW(params, lr=1e-3, foreach=True)


def _optimizer_state(opt, device_type: str) -> list:
    import torch

    return [v for state in opt.state.values() for v in state.values()
            if torch.is_tensor(v) and v.device.type == device_type]


def _token_ids(model, batch_size: int, seq_len: int, variant: str, device_type: str):
    import torch

    from pipeline.modeling import vocabulary_size

    vocab = BLOG_ID_RANGE if variant == "blog" else vocabulary_size(model)
    return torch.randint(0, vocab, (batch_size, seq_len), device=device_type)


def _loss(model, ids, variant: str):
    import torch

    if variant == "blog":
        return torch.mean(model(ids, use_cache=True).logits)
    return model(input_ids=ids, labels=ids).loss


# ----------------------------------------------------------------------------- command line


def add_cli(subparsers) -> None:
    from pipeline.arguments import positive_int

    parser = subparsers.add_parser("simulate", help="predict the training-step peak memory without a GPU")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="model id (registry entry or the Hub)")
    source.add_argument("--config", help="a Hugging Face config.json")
    parser.add_argument("--batch", type=positive_int, required=True)
    parser.add_argument("--seq", type=positive_int, required=True)
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--attn-implementation", choices=("default", "sdpa", "eager"), default="default")
    parser.add_argument("--variant", choices=VARIANTS, default="standard")
    parser.add_argument("--configs", default="results/configs.json",
                        help="output of `pipeline configs`, looked up first for --model")
    parser.add_argument("--json", action="store_true")
    parser.set_defaults(handler=_simulate_command)

    stage = subparsers.add_parser("simulate-peaks", help="simulate every point of the measured peak table")
    stage.add_argument("--peaks", default="results/peak_memory.parquet")
    stage.add_argument("--configs", default="results/configs.json")
    stage.add_argument("--out", default="results/simulated.parquet")
    stage.add_argument("--workers", type=positive_int, default=1, help="processes (models are spread over them)")
    stage.set_defaults(handler=_simulate_peaks_command)


def _simulate_command(args) -> int:
    resolved = _resolve(args.model, args.config, args.configs)
    result = predict_peak(resolved.config, args.batch, args.seq, args.precision, args.optimizer,
                          args.checkpointing, args.attn_implementation, args.variant)
    result.update(model_id=resolved.model_id, config_source=resolved.source, config_revision=resolved.revision)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{resolved.model_id} {args.precision} B={args.batch} L={args.seq}: "
              f"peak {result['peak_bytes'] / 2**30:.3f} GiB in {result['peak_phase']} ({result['seconds']:.2f} s)")
    return 0


def _resolve(model_id, config_path, configs_path):
    """--config PATH, or --model ID from configs.json when it has it, else the registry or the Hub."""
    from pathlib import Path

    from pipeline.configs import ResolvedConfig, config_from_dict, resolve_model

    if model_id and not config_path and Path(configs_path).exists():
        record = load_config_records(configs_path).get(model_id)
        if record is not None:
            return ResolvedConfig(model_id, config_from_dict(record["config"], model_id), record.get("config_source"),
                                  record.get("config_revision"))
    return resolve_model(model_id, config_path)


def _simulate_peaks_command(args) -> int:
    frame = simulate_peaks(args.peaks, args.configs, args.out, args.workers)
    counts = frame["simulate_status"].value_counts().to_dict()
    print(f"simulate-peaks: {len(frame)} points -> {args.out} ({', '.join(f'{k}: {v}' for k, v in counts.items())})")
    return 0


SIMULATED_COLUMNS = ("simulated_peak_bytes", "simulated_forward_peak_bytes", "simulated_backward_peak_bytes",
                     "simulated_optimizer_peak_bytes", "simulated_saved_bytes", "simulated_optimizer_state_bytes",
                     "simulated_peak_phase", "simulate_status", "simulate_reason", "simulate_seconds")


def simulate_peaks(peaks_path, configs_path, out_path, workers: int = 1):
    """The simulator's prediction for every measured point (ok and oom rows).

    Points of one model and precision run in one process (its meta model is built once);
    `workers` > 1 spreads the models over that many forked processes.
    """
    import pandas as pd

    from pipeline.io import write_parquet
    from pipeline.provenance import provenance

    peaks = _read_table(peaks_path)
    configs = load_config_records(configs_path)
    keys = ["model_id", "precision", "variant", "optimizer", "gradient_checkpointing", "attn_implementation",
            "batch_size", "seq_len"]
    missing = [k for k in keys + ["status"] if k not in peaks.columns]
    if missing:
        raise UserError(f"{peaks_path}: missing columns {', '.join(missing)}")
    points = peaks[peaks["status"].isin(["ok", "oom"])][keys].drop_duplicates()
    points = points.sort_values(["model_id", "precision", "attn_implementation"])
    groups = [group.to_dict("records") for _, group in points.groupby("model_id", sort=False)]
    rows = [row for chunk in _map(functools.partial(_simulate_rows, configs=configs), groups, workers)
            for row in chunk]
    frame = pd.DataFrame(rows, columns=keys + list(SIMULATED_COLUMNS))
    for column, value in provenance(include_device=False).items():
        frame[column] = value
    frame["config_source"] = frame["model_id"].map(lambda m: configs.get(m, {}).get("config_source"))
    frame["config_revision"] = frame["model_id"].map(lambda m: configs.get(m, {}).get("config_revision"))
    write_parquet(frame, out_path)
    return frame


def _simulate_rows(points: list[dict], configs: dict) -> list[dict]:
    return [dict(point, **_simulate_row(point, configs)) for point in points]


def _map(function, items: list, workers: int) -> list:
    if workers <= 1 or len(items) <= 1:
        return [function(item) for item in items]
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(min(workers, len(items))) as pool:
        return pool.map(function, items, chunksize=1)


def _read_table(path):
    import pandas as pd

    try:
        return pd.read_parquet(path)
    except FileNotFoundError:
        raise UserError(f"{path}: peak table not found") from None
    except Exception as exc:  # noqa: BLE001 - not a parquet file
        raise UserError(f"{path}: not a readable parquet table ({type(exc).__name__})") from None


def load_config_records(path) -> dict:
    """configs.json's ok records by model id (each model's config is parsed when it is used, so
    that one bad config does not stop the others)."""
    from pathlib import Path

    try:
        records = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: configs file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"{path}: not a JSON configs file") from None
    if not isinstance(records, dict):
        raise UserError(f"{path}: not a JSON object of model records")
    return {model_id: r for model_id, r in records.items() if isinstance(r, dict) and r.get("status") == "ok"}


def _simulate_row(point: dict, configs: dict) -> dict:
    row = dict.fromkeys(SIMULATED_COLUMNS)
    record = configs.get(point["model_id"])
    if record is None:
        return dict(row, simulate_status="skipped", simulate_reason="no config in the configs file")
    try:
        result = predict_peak(record["config"], int(point["batch_size"]), int(point["seq_len"]), point["precision"],
                              point["optimizer"], bool(point["gradient_checkpointing"]),
                              point["attn_implementation"], point["variant"])
    except Exception as exc:  # noqa: BLE001 - one failing model becomes a row with its reason
        return dict(row, simulate_status="error", simulate_reason=_first_line(exc))
    phases = result["phase_peaks"]
    return dict(row, simulated_peak_bytes=result["peak_bytes"], simulated_forward_peak_bytes=phases["forward"],
                simulated_backward_peak_bytes=phases["backward"], simulated_optimizer_peak_bytes=phases["optimizer"],
                simulated_saved_bytes=result["saved_bytes"],
                simulated_optimizer_state_bytes=result["optimizer_state_bytes"],
                simulated_peak_phase=result["peak_phase"], simulate_status="ok", simulate_seconds=result["seconds"])
