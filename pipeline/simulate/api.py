"""The simulator's entry point: `simulate(config, run)`, the run's peak on meta tensors by its client."""

from __future__ import annotations

from pipeline.simulate.distributed.peak import distributed_peak
from pipeline.simulate.clients.dpo import dpo_peak
from pipeline.simulate.clients.grpo import rollout_peak
from pipeline.simulate.predict import loop_peak
from pipeline.simulate.clients.sft import sft_peak
from pipeline.simulate.clients.trainer import trainer_peak
from pipeline.core.vocabulary import ROLLOUT_CLIENTS
from pipeline.training.values import Estimate, Run


def simulate(config, run: Run) -> Estimate:
    """The run's peak on meta tensors, by its client: the loop (`loop_peak`), transformers.Trainer
    (`trainer_peak`), TRL's SFTTrainer (`sft_peak`), DPOTrainer (`dpo_peak`), GRPOTrainer and RLOOTrainer
    (`rollout_peak`) or several GPUs (`distributed_peak`). A rollout's decode steps are replayed where they
    repeat (`memory.decode`); where a checked step differs, the run is simulated again with every step traced."""
    from pipeline.simulate.memory.decode import DecodeDiverged, replay_disabled

    try:
        return simulated(config, run)
    except DecodeDiverged:
        with replay_disabled():
            return simulated(config, run)


def simulated(config, run: Run) -> Estimate:
    if run.layout.sharded:
        return distributed_peak(config, run)
    if run.client == "trainer":
        return trainer_peak(config, run)
    if run.client == "sft":
        return sft_peak(config, run)
    if run.client == "dpo":
        return dpo_peak(config, run)
    if run.client in ROLLOUT_CLIENTS:
        return rollout_peak(config, run)
    return loop_peak(config, run)


def trace(gpu: str | None = None, *, gpu_memory_gib: float | None = None, device: str = "meta",
          fresh_process: bool = True, world_size: int = 1):
    """`pipeline.trace`: any training code run under the simulator (`pipeline.simulate.trace.trace`); with
    `world_size` N > 1 as rank 0 of N, the code building its own mesh and calling fully_shard /
    parallelize_module (`pipeline.simulate.distributed.traced`)."""
    from pipeline.core.vocabulary import MAX_GPUS, check_positive_int
    from pipeline.simulate.trace import trace as one_gpu

    made = one_gpu(gpu, gpu_memory_gib=gpu_memory_gib, device=device, fresh_process=fresh_process)
    if check_positive_int("world_size", world_size, MAX_GPUS) == 1:
        return made
    from pipeline.simulate.distributed.traced import ShardedTrace

    return ShardedTrace(world_size, device, gpu=made.gpu, warm=made.warm)
