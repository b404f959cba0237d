"""The rows of models.parquet and activations.parquet for one model, within the time limits."""

from __future__ import annotations

import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass

from pipeline.activations.counts import Measurement, ModelCounter, PointTimeout, one_line
from pipeline.activations.points import (
    DEFAULT_POINTS,
    HOOK_DTYPES,
    MODEL_TIME_LIMIT_S,
    POINT_ESTIMATE_LIMIT_S,
    POINT_SETS,
    POINT_TIME_LIMIT_S,
    PRECISION_BYTES,
    PointSet,
)
from pipeline.modeling import architecture_facts, parameter_counts


MODEL_COLUMNS = (
    "model_id", "family", "model_type", "status", "reason", "config_source", "config_revision", "parameters",
    "embedding_parameters", "non_embedding_parameters", "active_parameters", "is_moe", "num_experts",
    "num_experts_per_tok", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
    "num_key_value_heads", "head_dim", "vocab_size", "context_length", "tie_word_embeddings", "attention_kind",
    "seconds",  # to count the model, building included
)
ACTIVATION_COLUMNS = (
    "model_id", "family", "model_type", "parameters", "method", "dtype", "batch_size", "seq_len", "tokens",
    "elements", "elements_per_token", "bytes", "bytes_per_token", "forward", "status", "reason", "seconds",
    "config_source", "config_revision",
)


@dataclass
class ModelJob:
    model_id: str
    family: str | None
    model_type: str | None
    config: object | None  # transformers config; None when there is none to count
    config_source: str | None = None
    config_revision: str | None = None
    skip_reason: str | None = None  # the configs stage skipped the model
    config_error: str | None = None  # the configs stage's config does not load


def count_model(job: ModelJob, points: PointSet = POINT_SETS[DEFAULT_POINTS]):
    """(models row, activation rows) of one model; a failure becomes rows with status and reason."""
    start = time.perf_counter()
    base = {"model_id": job.model_id, "family": job.family, "model_type": job.model_type,
            "config_source": job.config_source, "config_revision": job.config_revision}
    model_row = {**base, "status": "ok", "reason": None}
    rows = []
    if job.config is None:
        model_row.update(status="error" if job.config_error else "skipped", reason=job.config_error or job.skip_reason)
    else:
        try:
            counter = ModelCounter(job.config)
            model_row.update(architecture_facts(job.config))
            counts = parameter_counts(counter.model("float32"), job.config)
        except Exception as exc:  # noqa: BLE001 - a config transformers cannot build: the model is an error row
            model_row.update(status="error", reason=one_line(exc))
        else:
            model_row.update({k: counts[k] for k in MODEL_COLUMNS if k in counts},
                             is_moe=bool(counts["routed_expert_parameters"]))
            base["parameters"] = counts["parameters"]
            wanted = [("hook", "float32", b, s) for b, s in points.hook]
            wanted += [("saved", p, b, s) for p in points.precisions for b, s in points.saved]
            rows = measure_points(counter, base, wanted, model_row["context_length"])
    model_row["seconds"] = round(time.perf_counter() - start, 3)
    return model_row, rows


def measure_points(counter: ModelCounter, base: dict, wanted: list, context: int | None) -> list[dict]:
    """One row per point (two per hook point: float32 and bfloat16 bytes), within the time limits."""
    estimate = TimeEstimate()
    deadline = time.perf_counter() + MODEL_TIME_LIMIT_S
    rows = []
    for method, dtype, batch, seq in wanted:
        left = deadline - time.perf_counter()
        if context and seq > context:
            measurement = Measurement(status="skipped", reason=f"seq_len {seq} beyond the context length {context}")
        elif (estimated := estimate.seconds(seq, method)) > POINT_ESTIMATE_LIMIT_S:
            measurement = Measurement(status="skipped", reason=(
                f"estimated {estimated:.0f} s: the forward's time grows with the sequence length"))
        elif left <= 0:
            measurement = Measurement(status="error", reason=f"model time limit of {MODEL_TIME_LIMIT_S:.0f} s reached")
        else:
            try:
                with time_limit(min(POINT_TIME_LIMIT_S, left)):
                    measurement = counter.hook(batch, seq) if method == "hook" else counter.saved(batch, seq, dtype)
                estimate.observe(seq, measurement.seconds, method)
            except PointTimeout as exc:
                measurement = Measurement(status="error", reason=str(exc))
        rows.extend(_rows(base, method, dtype, batch, seq, measurement))
    return rows


def _rows(base, method, dtype, batch, seq, measurement: Measurement) -> list[dict]:
    tokens = batch * seq
    ok = measurement.status == "ok"
    row = {
        **base, "method": method, "dtype": dtype, "batch_size": batch, "seq_len": seq, "tokens": tokens,
        "elements": measurement.elements if ok else None,
        "elements_per_token": measurement.elements / tokens if ok else None,
        "bytes": measurement.bytes if ok else None,
        "bytes_per_token": measurement.bytes / tokens if ok and measurement.bytes is not None else None,
        "forward": measurement.forward, "status": measurement.status, "reason": measurement.reason,
        "seconds": round(measurement.seconds, 4),
    }
    if method == "saved":
        return [row]
    rows = []
    for hook_dtype in HOOK_DTYPES:  # bytes = elements x element size of the dtype (DESIGN.md)
        nbytes = measurement.elements * PRECISION_BYTES[hook_dtype] if ok else None
        rows.append({**row, "dtype": hook_dtype, "bytes": nbytes,
                     "bytes_per_token": nbytes / tokens if ok else None})
    return rows


@contextmanager
def time_limit(seconds: float | None):
    """Raise PointTimeout in the main thread after `seconds` (no limit elsewhere or when None)."""
    import threading

    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise PointTimeout(f"time limit of {seconds:.0f} s reached")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class TimeEstimate:
    """Seconds a forward spends per sequence position, from the hook forwards (which run first, from
    L=1 to L=1024). A meta forward costs about the same at any L, except where the model loops over
    the sequence in Python (a recurrent scan without its CUDA kernel): then the cost grows with L."""

    def __init__(self):
        self.first = None  # (seq_len, seconds) of the first hook forward
        self.seconds_per_position = 0.0

    def observe(self, seq: int, seconds: float, method: str) -> None:
        if method != "hook":
            return  # a training forward costs more at any L: comparing it with a hook forward says nothing
        if self.first is None:
            self.first = (seq, seconds)
        elif seq > self.first[0]:  # the longest hook forward so far: the least noisy slope
            self.seconds_per_position = max(0.0, (seconds - self.first[1]) / (seq - self.first[0]))

    def seconds(self, seq: int, method: str) -> float:
        return self.seconds_per_position * seq * (2 if method == "saved" else 1)  # a training forward: ~2x
