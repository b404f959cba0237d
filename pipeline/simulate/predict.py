"""`predict_peak`: the peak memory of the standard training step on an H200, without a GPU and
without weights (the model built on the meta device, built once per config, precision and attention).
"""

from __future__ import annotations

import functools
import json
import time

from pipeline.errors import UserError
from pipeline.vocabulary import OPTIMIZERS, PRECISIONS, VARIANTS, check_choice, check_positive_int

# The simulator also takes "sdpa" (transformers' name for the default on current models).
ATTENTIONS = ("default", "sdpa", "eager")


def predict_peak(config, batch_size: int, seq_len: int, precision: str = "fp32", optimizer: str = "adamw",
                 gradient_checkpointing: bool = False, attn_implementation: str | None = None,
                 variant: str = "standard", adapter=None, reserve_limit: int | None = None) -> dict:
    """Predicted `torch.cuda.max_memory_allocated()` of the standard training step on an H200.

    `config`: a transformers config or a config.json dict. Returns peak_bytes, components (bytes by
    role at the peak moment), phase_peaks, saved_bytes (autograd saved-for-backward storages of the
    forward, parameters excluded), peak_reserved_bytes (`torch.cuda.max_memory_reserved()`),
    peak_reserved_expandable_bytes (the same with `expandable_segments:True`) and seconds.

    `adapter`: a `pipeline.adapters.AdapterSpec` (LoRA / QLoRA), run by PEFT's own wrapping on a
    meta model of its own (`pipeline.simulate.adapters`); `trainable_parameters` is then returned too.
    `reserve_limit`: the bytes the process may reserve on its GPU; the reserved replay then gives
    cached segments back at that edge as the allocator does (`reserve_limit_exceeded`: it ran out).
    """
    from pipeline.simulate.step import simulate_training_step

    start = time.perf_counter()
    check_inputs(batch_size, seq_len, precision, optimizer, gradient_checkpointing, attn_implementation, variant)
    config = _as_config(config)
    if adapter is None:
        model = cached_meta_model(_config_key(config), precision, _attention(attn_implementation))
    else:
        from pipeline.simulate.adapters import cached_adapter_model, check_adapter

        check_adapter(adapter, variant)
        model = cached_adapter_model(_config_key(config), precision, _attention(attn_implementation), adapter,
                                     gradient_checkpointing)
    result = simulate_training_step(model, batch_size, seq_len, precision, optimizer, gradient_checkpointing,
                                    variant, device_type="meta", reserve_limit=reserve_limit)
    if adapter is not None:
        from pipeline.adapters import trainable_parameters

        result["trainable_parameters"] = trainable_parameters(model)
    result["seconds"] = time.perf_counter() - start
    return result


def check_inputs(batch_size, seq_len, precision, optimizer, gradient_checkpointing, attn_implementation,
                 variant) -> None:
    check_positive_int("batch_size", batch_size)
    check_positive_int("seq_len", seq_len)
    check_choice("precision", precision, PRECISIONS)
    check_choice("optimizer", optimizer, OPTIMIZERS)
    check_choice("variant", variant, VARIANTS)
    if attn_implementation is not None:
        check_choice("attn_implementation", attn_implementation, ATTENTIONS)
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
        raise UserError(f"the model cannot be built from this config: {first_line(exc)}") from None


def first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"[:300]
