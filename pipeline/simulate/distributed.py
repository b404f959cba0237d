"""`predict_distributed_peak`: the per-GPU (rank 0) peak of the standard training step under DDP or
FSDP2 on N GPUs, without GPUs and without weights.

The real torch sharding code runs on the model built on the meta device, in one process, with a
fake process group of N ranks (`distributed_world.fake_world`: collectives return at once, as in
torch.distributed._tools.fsdp2_mem_tracker and torchtitan's memory estimation). FSDP2 runs with
its device set to "meta" (`distributed_world.meta_fsdp`, which says why this way and not with
FakeTensorMode), so every buffer (sharded parameters, all-gather outputs, unsharded parameters,
reduce-scatter inputs, the sharded gradients) is made and freed by FSDP2's own code; DDP's
gradient buckets (bucket_cap_mb 25, the first bucket 1 MiB, rebuilt in the second step) by its
Reducer. The simulator's tracker and allocator replay count them as on the single GPU
(`pipeline.simulate.step`), and the CPU check (`distributed_check`) runs the same step for real
with gloo on N processes.

Modules: `distributed_world` (fake process group, FSDP2 on meta, sharding), `distributed_tracker`
(DTensors, resized storages, roles), `distributed_step` (the three steps), `distributed_check`.
"""

from __future__ import annotations

import time

from pipeline.errors import UserError

from pipeline.vocabulary import SHARDINGS


def predict_distributed_peak(config, batch_size: int, seq_len: int, precision: str = "fp32", num_gpus: int = 2,
                             sharding: str = "fsdp", gradient_checkpointing: bool = False, optimizer: str = "adamw",
                             attn_implementation: str | None = None) -> dict:
    """Predicted `torch.cuda.max_memory_allocated()` of rank 0 of `num_gpus` in the standard step
    with `batch_size` sequences per GPU, under `sharding` (ddp, fsdp, fsdp-no-reshard).

    Returns peak_bytes, components (bytes by role at the peak: parameters (this rank's shards),
    unsharded_parameters, all_gather, reduce_scatter, ddp_buckets, gradients, optimizer_state,
    optimizer_intermediates, activations), peak_phase, phase_peaks, phase_components (the roles at
    each phase's peak), peak_reserved_bytes, peak_reserved_expandable_bytes (one-stream replays of
    the caching allocator: FSDP2's own streams on CUDA are not replayed), num_gpus, sharding and
    seconds. amp-fp16 (its gradient scaler) is refused.
    """
    from pipeline.modeling import build
    from pipeline.simulate.distributed_step import simulate_sharded_step
    from pipeline.simulate.distributed_world import fake_world, meta_fsdp
    from pipeline.simulate.predict import _as_config, _attention, check_inputs, first_line

    start = time.perf_counter()
    check_inputs(batch_size, seq_len, precision, optimizer, gradient_checkpointing, attn_implementation, "standard")
    check_sharding(num_gpus, sharding)
    if precision == "amp-fp16":
        raise UserError("amp-fp16 (a gradient scaler over sharded gradients) is not simulated under ddp or fsdp yet")
    config = _as_config(config)
    try:
        model = build(config, precision, _attention(attn_implementation) or "default", device="meta")
    except Exception as exc:  # noqa: BLE001 - transformers rejects some configs / attention choices
        raise UserError(f"the model cannot be built from this config: {first_line(exc)}") from None
    with fake_world(num_gpus) as mesh, meta_fsdp():
        result = simulate_sharded_step(model, sharding, mesh, batch_size, seq_len, precision, optimizer,
                                       gradient_checkpointing, device_type="meta")
    result.update(num_gpus=num_gpus, sharding=sharding, seconds=time.perf_counter() - start)
    return result


def check_sharding(num_gpus, sharding) -> None:
    from pipeline.vocabulary import check_choice, check_positive_int

    check_positive_int("num_gpus", num_gpus)
    check_choice("sharding", sharding, SHARDINGS)
