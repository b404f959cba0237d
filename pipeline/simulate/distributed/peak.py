"""`distributed_peak`: the per-GPU (rank 0's; every rank measured equal) peak of the standard training step
under DDP, FSDP2, HSDP and tensor parallelism on N GPUs, without GPUs and without weights.

The real torch sharding code runs on the model built on the meta device, in one process, with a
fake process group of N ranks (`world.fake_world`: collectives return at once, as in
torch.distributed._tools.fsdp2_mem_tracker and torchtitan's memory estimation). FSDP2 runs with
its device set to "meta" (`world.meta_fsdp`, which says why this way and not with
FakeTensorMode), so every buffer (sharded parameters, all-gather outputs, unsharded parameters,
reduce-scatter inputs, the sharded gradients) is made and freed by FSDP2's own code; DDP's
gradient buckets (bucket_cap_mb 25, the first bucket 1 MiB, rebuilt in the second step) by its
Reducer. The simulator's tracker and allocator replay count them as on the single GPU, each CUDA
stream's blocks in a pool of its own (FSDP2's all-gather and reduce-scatter streams keep theirs), and the
CPU check (`check`) runs the same step for real with gloo on N processes.

Modules: `world` (fake process group, FSDP2 on meta, sharding), `tracker` (DTensors, resized storages,
roles), `step` (the three steps), `clients` (the Trainer clients under accelerate), `traced`
(`pipeline.trace(world_size=N)`), `check`.
"""

from __future__ import annotations

import time

from pipeline.core.errors import UserError

from pipeline.training.values import Estimate, Run


def distributed_peak(config, run: Run) -> Estimate:
    """Predicted `torch.cuda.max_memory_allocated()` of rank 0 of `run.num_gpus` in the standard step
    with `run.batch` sequences per GPU, under `run.sharding` (ddp, fsdp, fsdp-no-reshard); the Trainer clients
    (trainer, sft, dpo) by `clients.sharded_client_peak`.

    Answers the peak, its components (bytes by role at the peak: parameters (this rank's shards),
    unsharded_parameters, all_gather, reduce_scatter, ddp_buckets, gradients, optimizer_state,
    optimizer_intermediates, activations), the reserved bytes (one-stream replays of the caching
    allocator: FSDP2's own streams on CUDA are not replayed) and, in details, peak_phase,
    phase_peaks, phase_components (the roles at each phase's peak), num_gpus, sharding and seconds.
    amp-fp16 (its gradient scaler) is refused.
    """
    from pipeline.inputs.modeling import build
    from pipeline.simulate.distributed.step import simulate_sharded_step
    from pipeline.simulate.distributed.world import fake_world, meta_fsdp
    from pipeline.core.text import first_line
    from pipeline.simulate.predict import as_config, check_loop, estimate_of, meta_attention

    if run.client != "loop":
        from pipeline.simulate.distributed.clients import sharded_client_peak

        return sharded_client_peak(config, run)
    start = time.perf_counter()
    check_loop(run)
    if run.precision == "amp-fp16":
        raise UserError("amp-fp16 (a gradient scaler over sharded gradients) is not simulated under ddp or fsdp yet")
    config = as_config(config)
    try:
        model = build(config, run.precision, meta_attention(run.attn_implementation) or "default", device="meta")
    except Exception as exc:  # noqa: BLE001 - transformers rejects some configs / attention choices
        raise UserError(f"the model cannot be built from this config: {first_line(exc)}") from None
    with fake_world(run.layout) as mesh, meta_fsdp():
        result = simulate_sharded_step(model, run, mesh, device_type="meta")
    result.update(run.layout.columns())
    return estimate_of(result, start)
