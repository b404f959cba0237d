"""The simulator's entry point: `simulate(config, run)`, the run's peak on meta tensors by its client."""

from __future__ import annotations

from pipeline.simulate.distributed.peak import distributed_peak
from pipeline.simulate.clients.dpo import dpo_peak
from pipeline.simulate.predict import loop_peak
from pipeline.simulate.clients.sft import sft_peak
from pipeline.simulate.clients.trainer import trainer_peak
from pipeline.training.values import Estimate, Run


def simulate(config, run: Run) -> Estimate:
    """The run's peak on meta tensors, by its client: the loop (`loop_peak`), transformers.Trainer
    (`trainer_peak`), TRL's SFTTrainer (`sft_peak`) and DPOTrainer (`dpo_peak`) or several GPUs
    (`distributed_peak`)."""
    if run.layout.sharded:
        return distributed_peak(config, run)
    if run.client == "trainer":
        return trainer_peak(config, run)
    if run.client == "sft":
        return sft_peak(config, run)
    if run.client == "dpo":
        return dpo_peak(config, run)
    return loop_peak(config, run)
