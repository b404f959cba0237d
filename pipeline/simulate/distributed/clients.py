"""The Trainer clients on several GPUs: what `torchrun --nproc_per_node N` (or `accelerate launch`) runs with a
Trainer, SFTTrainer or DPOTrainer script, simulated for rank 0 by running that code.

The client's own simulation (`pipeline.simulate.clients`: the real trainer built, its `_prepare_for_training`
and its steps in the Trainer's order) runs inside the world of one rank of N:

- torch's fake process group of N ranks and FSDP2 on meta (`world.fake_world`, `world.meta_fsdp`), with its
  streams: a request made on FSDP2's all-gather or reduce-scatter stream goes to that stream's pools of the
  allocator replay (`world.stream_name`);
- accelerate told it runs on N GPUs (`world.accelerate_on_gpus`), so that its own code decides what happens:
  DDP's wrapper with the Trainer's kwargs (find_unused_parameters, buckets), or under the FSDP plugin
  (`fsdp=True`, `fsdp_config` version 2, `pipeline.training.sharding.sharding_arguments`) its FSDP2
  preparation: the low-precision trainable weights upcast to fp32 (mixed precision is FSDP2's
  `MixedPrecisionPolicy` then, not autocast), the decoder layers, the embeddings and the tail sharded;
- the model given on the host, as `from_pretrained` leaves it: built on meta and not counted until it arrives
  on the GPU (`world.arrivals`): the Trainer moves it there in its `__init__` under DDP (DPOTrainer its
  reference model too), FSDP2 moves and shards one module at a time inside `fully_shard`;
- the peak counters reset when training begins (`on_train_begin`, after `_prepare_for_training`), as the
  measurement resets them (`pipeline.measure.distributed`).

DeepSpeed's ZeRO (sharding zero1-3, the run's `deepspeed` config): accelerate's DeepSpeed plugin calls
`deepspeed.initialize`, whose code runs on meta (`zero.meta_deepspeed`); under zero3 the model is built
partitioned, under `deepspeed.zero.Init`, as a script builds it after its training arguments (`zero_init`).

Not simulated (one line each, UserError): amp-fp16 (a gradient scaler over sharded gradients), QLoRA under
FSDP2 and ZeRO (accelerate leaves 4-bit weights out of the sharding), Liger's kernels under FSDP2 and ZeRO.
"""

from __future__ import annotations

import contextlib
import time

from pipeline.core.errors import UserError
from pipeline.core.vocabulary import ROLLOUT_CLIENTS
from pipeline.training.values import Estimate, Run


class World:
    """One rank's world for a `TrainerRun` (its `world`): the preparation in it, and where training begins."""

    def __init__(self, trace):
        self.trace = trace

    @contextlib.contextmanager
    def preparing(self, run):
        """`_prepare_for_training` on the host: what arrives on the GPU is counted when it does."""
        with self.trace.tracker.placed(host=True):
            yield

    def training_begins(self, run) -> None:
        """on_train_begin: the models on the GPU now are counted as parameters, the peak counters reset."""
        for model in run.models():
            self.trace.watch(model)
        if run.trainer.is_deepspeed_enabled:
            from pipeline.simulate.distributed.zero import retag_states

            optimizer, tracker = run.trainer.model_wrapped.optimizer, self.trace.tracker
            if tracker.host_placement is not None:
                tracker.host_placement.take(getattr(optimizer, "param_buffer_of_bit16_for_cpu_offload_groups", ()),
                                            tracker)
            retag_states(optimizer, tracker)
        self.trace.tracker.reset_peaks()


def sharded_client_peak(config, run: Run) -> Estimate:
    """Rank 0's peak of `run` (client trainer, sft or dpo; `run.num_gpus`, `run.sharding`) on meta tensors, as
    the single-GPU clients answer: peak allocated and reserved, components (FSDP2's all-gather and
    reduce-scatter buffers, DDP's buckets among them), phase peaks; `trainable_parameters` with adapters."""
    from pipeline.simulate.clients.trainer import check_installed, simulate_run, trainer_trace
    from pipeline.simulate.crashes import refusals_are_crashes
    from pipeline.simulate.distributed.step import roles
    from pipeline.simulate.distributed.tracker import ShardedTracker, host_copy_stand_ins
    from pipeline.simulate.distributed.world import (accelerate_on_gpus, arrivals, fake_world, meta_fsdp,
                                                     stream_name)
    from pipeline.simulate.predict import as_config

    start = time.perf_counter()
    check_sharded_client(run)
    check_installed(run.optim, run.liger_kernel)
    config = as_config(config)
    rollout = run.client in ROLLOUT_CLIENTS
    stand_ins = host_copy_stand_ins()
    if rollout:
        from pipeline.simulate.clients.grpo import sampler_stand_ins

        stand_ins.update(sampler_stand_ins())
    trace = trainer_trace("meta", run.reserve_limit, warm=not run.fresh_process, tracker_class=ShardedTracker,
                          more_stand_ins=stand_ins, host_values=rollout)
    tracker = trace.tracker
    tracker.stream = stream_name
    with fake_world(run.layout), meta_fsdp(), accelerate_on_gpus(run.num_gpus), arrivals(tracker), roles(tracker), \
            deepspeed_world(run, tracker) as host:
        with refusals_are_crashes():
            with zero_init(run, trace):
                model = host_model(config, run, trace)
            with trace.rules, tracker, tracker.placed(host=True):  # the trainer's __init__ (DDP moves the model)
                trainer = trainer_of(model, run, trace)
        step_run = run_class(run.client)(trainer, run.seq, run.precision, run.checkpointing, "meta")
        step_run.world = World(trace)
        result = simulate_run(step_run, trace=trace)
    result.update(run.layout.columns())
    if host is not None:
        result["host_peak_bytes"] = host.peak
    if run.adapter is not None:
        from pipeline.training.adapters import trainable_parameters

        result["trainable_parameters"] = trainable_parameters(trainer.model)
    from pipeline.simulate.predict import estimate_of

    return estimate_of(result, start)


@contextlib.contextmanager
def deepspeed_world(run: Run, tracker):
    """DeepSpeed on the meta device (`zero.meta_deepspeed`) for zero1-3, else nothing; yields ZeRO-Offload's host
    placement (None without offload)."""
    if run.deepspeed is None:
        yield None
        return
    from pipeline.simulate.distributed.zero import meta_deepspeed
    from pipeline.training.zero import offload_devices

    with meta_deepspeed(tracker, "cpu" in offload_devices(run.deepspeed).values()) as placement:
        yield placement


@contextlib.contextmanager
def zero_init(run: Run, trace):
    """Where the model is built: on the host, or under zero3 as `from_pretrained` builds it once the training
    arguments name a ZeRO-3 config (transformers' `HfDeepSpeedConfig` in force: `deepspeed.zero.Init`), each
    parameter partitioned on the GPU as it is made, counted."""
    if run.sharding != "zero3" or (run.adapter is not None and run.adapter.quantization):
        yield  # transformers builds a quantized model without zero.Init; deepspeed.initialize partitions it
        return
    from pipeline.simulate.distributed.zero import zero3_build

    with trace.rules, trace.tracker, zero3_build(run, trace.tracker):
        yield


def check_sharded_client(run: Run) -> None:
    from pipeline.core.vocabulary import precision_mode
    from pipeline.simulate.adapters import check_adapter

    if run.adapter is not None:
        check_adapter(run.adapter, run.variant)
    if run.layout.sharding == "hsdp" or run.layout.tensor_parallel > 1:
        raise UserError(f"{run.layout.describe()} is simulated for the loop client; the {run.client} client runs "
                        "ddp, fsdp and fsdp-no-reshard")
    if precision_mode(run.precision).scaler:
        raise UserError("amp-fp16 (a gradient scaler over sharded gradients) is not simulated on several GPUs yet")
    if run.sharding != "ddp" and run.liger_kernel:
        raise UserError("Liger's kernels under FSDP2 and ZeRO are not simulated yet; ddp is")
    if run.deepspeed is not None:
        import importlib.util

        if importlib.util.find_spec("deepspeed") is None:
            raise UserError("sharding zero1-3 runs DeepSpeed's code, which is not installed here "
                            "(pip install -e \".[deepspeed]\")")


def host_model(config, run: Run, trace):
    """The model the client is given, as the script has it: on the host (built on meta, not counted) the base for
    SFTTrainer and DPOTrainer (they wrap the adapters themselves), the PeftModel for the Trainer; a 4-bit base on
    the GPU, counted, as `from_pretrained` loads it on each rank (bitsandbytes' loader puts the whole quantized
    model on the rank's GPU; the sharding comes after), stored as the sharding needs (`AdapterSpec.for_sharding`)."""
    from pipeline.simulate.adapters import fresh_adapter_model, fresh_base_model, loaded_from_checkpoint
    from pipeline.simulate.predict import config_key, meta_attention
    from pipeline.training.adapters import apply_adapters

    key, attention = config_key(config), meta_attention(run.attn_implementation)
    adapter = run.adapter.for_sharding(run.sharding) if run.adapter else None
    if adapter is not None and adapter.quantization:
        skeleton = fresh_base_model(key, run.precision, attention, adapter.quantization, adapter.quant_storage)
        if run.client == "trainer":
            return trace.record(lambda: apply_adapters(loaded_from_checkpoint(skeleton, trace.tracker), adapter,
                                                       run.checkpointing))
        return trace.record(lambda: loaded_from_checkpoint(skeleton, trace.tracker))
    if run.client == "trainer" and adapter is not None:
        if run.sharding == "zero3":  # built under zero.Init: a copy of a cached model would not be partitioned
            from pipeline.simulate.adapters import cached_adapter_model

            return cached_adapter_model.__wrapped__(key, run.precision, attention, adapter, run.checkpointing)
        return fresh_adapter_model(key, run.precision, attention, adapter, run.checkpointing)
    return fresh_base_model(key, run.precision, attention, None)


def trainer_of(model, run: Run, trace):
    """The client's trainer on `model`, with the sharding's arguments: the Trainer, SFTTrainer or DPOTrainer (with
    its reference model, on the host too), as the single-GPU simulation builds them."""
    from pipeline.simulate.clients.dpo import meta_dpo_trainer
    from pipeline.simulate.clients.parts import meta_trainer
    from pipeline.simulate.clients.sft import meta_sft_trainer
    from pipeline.training.dpo import reference_model

    setting = run.setting
    if run.client == "trainer":
        return meta_trainer(model, run.batch, run.precision, run.optim, run.gradient_accumulation, run.checkpointing,
                            "meta", run.liger_kernel, setting=setting)
    if run.client == "sft":
        return meta_sft_trainer(model, setting, run.precision, run.batch, run.seq, "meta")
    if run.client == "dpo":
        return meta_dpo_trainer(model, reference_model(model, setting, "meta"), setting, run.precision, run.batch,
                                run.seq, "meta", trace.rules)
    if run.client in ROLLOUT_CLIENTS:
        from pipeline.simulate.clients.grpo import meta_rollout_trainer
        from pipeline.training.grpo import check

        check(run.client, run.rollout, run.batch, run.gradient_accumulation, run.seq, run.layout.data_parallel)
        return meta_rollout_trainer(model, setting, run.precision, run.batch, run.seq, "meta", trace.rules)
    raise UserError(f"client {run.client} does not run on several GPUs here (the loop's sharded step does)")


def run_class(client: str):
    """The `TrainerRun` that runs the client's steps."""
    from pipeline.simulate.clients.dpo import DPORun
    from pipeline.simulate.clients.sft import SFTRun
    from pipeline.simulate.clients.grpo import RolloutRun
    from pipeline.simulate.clients.trainer import TrainerRun

    return {"trainer": TrainerRun, "sft": SFTRun, "dpo": DPORun, "grpo": RolloutRun, "rloo": RolloutRun}[client]
