"""`count()`: parameters and activations per token of one model, for the command line and Python users."""

from __future__ import annotations

from pipeline.core.text import first_line
from pipeline.activations.counts import ModelCounter, quiet_transformers
from pipeline.activations.points import PRECISION_BYTES
from pipeline.core.errors import UserError
from pipeline.inputs.modeling import parameter_counts
from pipeline.core.vocabulary import MAX_BATCH, MAX_SEQ, MAX_TOKENS, check_choice, check_positive_int


def count(model: str | None = None, config: str | None = None, dtype: str = "float32", batch: int | None = None,
          seq: int | None = None, config_source: str = "auto", registry=None) -> dict:
    """Parameters and activations per token of one model (registry id, Hub id or config.json path).

    `elements_per_token` / `bytes_per_token` are the blog's hook method at (1, 1); with `batch` and
    `seq`, also the bytes saved for backward per token in the standard step at (batch, seq).
    """
    from pipeline.inputs.configs import resolve_model

    check_choice("dtype", dtype, PRECISION_BYTES)
    if (batch is None) != (seq is None):
        raise UserError("give both --batch and --seq, or neither")
    if batch is not None:
        batch, seq = check_positive_int("batch", batch, MAX_BATCH), check_positive_int("seq", seq, MAX_SEQ)
        if batch * seq > MAX_TOKENS:
            raise UserError(f"batch x seq = {batch * seq:,} tokens is more than the {MAX_TOKENS:,} this project counts")
    quiet_transformers()
    resolved = resolve_model(model, config, config_source, registry)
    counter = ModelCounter(resolved.config)
    try:
        counts = parameter_counts(counter.model("float32"), resolved.config)
    except Exception as exc:  # noqa: BLE001 - a config transformers cannot build is bad input here
        raise UserError(f"{resolved.model_id}: the model cannot be built ({first_line(exc)})") from None
    hook = counter.hook(1, 1)
    if hook.status != "ok":
        raise UserError(f"{resolved.model_id}: the forward failed ({hook.reason})")
    result = {
        "model_id": resolved.model_id,
        "parameters": counts["parameters"],
        "embedding_parameters": counts["embedding_parameters"],
        "non_embedding_parameters": counts["non_embedding_parameters"],
        "active_parameters": counts["active_parameters"],
        "elements_per_token": hook.elements,
        "bytes_per_token": hook.elements * PRECISION_BYTES[dtype],
        "dtype": dtype,
        "method": "hook",
        "forward": hook.forward,
        "config_source": resolved.source,
        "config_revision": resolved.revision,
    }
    if batch is not None:
        saved = counter.saved(batch, seq, dtype)
        result.update(batch_size=batch, seq_len=seq, saved_forward=saved.forward, saved_bytes=saved.bytes,
                      saved_bytes_per_token=saved.bytes / (batch * seq) if saved.bytes else None)
        if saved.status != "ok":
            result["saved_reason"] = saved.reason
    return result
