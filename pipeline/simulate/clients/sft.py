"""`sft_peak`: the peak memory of `client = sft` (TRL's SFTTrainer, `pipeline.training.sft`; the GPU run
is `pipeline.measure.clients.sft`) on meta tensors.

The real SFTTrainer is built (`SFTTrainer.__init__`: its dataset preparation with `datasets`, PEFT's
wrapping through `peft_config`, the bf16 cast of the adapters on a 4-bit base, its collator,
`add_fused_lm_head`) and its training steps run (`compute_loss`: the fused LM head, the entropy and
accuracy metrics) in the order `pipeline.simulate.clients.trainer.TrainerRun` runs transformers.Trainer's loop,
under the same tracker, kernel rules and allocator replay. What differs from a CUDA run, besides the
Trainer's stand-ins (`pipeline.simulate.clients.trainer`):

- the micro-batches are the prepared dataset's rows through SFTTrainer's own collator (host memory,
  not counted), then moved to the device with their host values (`pipeline.simulate.values.shadows`), which
  answer the fused head's data-dependent shapes (`hidden_states[labels != -100]`) exactly;
- TRL's fused head and Liger's wrappers take CUDA's code paths, their Triton launches are no-ops
  (`pipeline.simulate.kernels.paths`);
- the entropy and accuracy metrics' `.item()` (logged, never used for memory) answer 0.0.
"""

from __future__ import annotations

import time

from pipeline.core.vocabulary import OPTIMS, check_choice
from pipeline.simulate.predict import as_config, check_loop, config_key, estimate_of, meta_attention
from pipeline.simulate.clients.trainer import TrainerRun, check_installed, simulate_run
from pipeline.training.step import Setting
from pipeline.training.values import Estimate, Run


def sft_peak(config, run: Run) -> Estimate:
    """SFTTrainer's `train()` for three optimizer steps of `run.gradient_accumulation` micro-batches of
    `config` on meta tensors (client sft: `run.checkpointing`, `run.optim`, `run.liger_kernel`,
    `run.completion_share`, `run.adapter` as peft_config on a base in the precision's dtype, or 4-bit),
    answered as `loop_peak` answers; `trainable_parameters` in details with adapters."""
    from pipeline.training.sft import unavailable

    return trl_peak(config, run, "sft", unavailable, SFTRun, lambda model, setting, trace: meta_sft_trainer(
        model, setting, run.precision, run.batch, run.seq, "meta"))


def trl_peak(config, run: Run, client: str, unavailable, step_run, make_trainer, host_values: bool = False,
             stand_ins: dict | None = None) -> Estimate:
    """The TRL clients' simulation (`sft_peak`, `dpo_peak`): `run` checked (`unavailable()`: why the client
    cannot run here, or None), the base built in the precision's dtype (4-bit under QLoRA) and handed to
    `make_trainer(model, setting, trace)`, in the trace for a process's first point (`predict.run_model`),
    then `step_run(trainer, seq, precision, checkpointing, "meta")` run as the Trainer's loop (`host_values`,
    `stand_ins`: the trace's, `trainer_trace`)."""
    from pipeline.core.errors import UserError
    from pipeline.simulate.adapters import check_adapter, fresh_base_model, loaded_from_checkpoint
    from pipeline.simulate.clients.trainer import trainer_trace
    from pipeline.simulate.crashes import refusals_are_crashes

    start = time.perf_counter()
    if run.client != client:
        raise UserError(f"{client}_peak simulates client {client}, not {run.client}")
    check_choice("optim", run.optim, OPTIMS)
    check_loop(run)
    reason = unavailable()
    if reason:
        raise UserError(f"{reason} (pip install trl==1.16.0)")
    check_installed(run.optim, run.liger_kernel)
    config = as_config(config)
    if run.adapter is not None:
        check_adapter(run.adapter, "standard")
    setting = run.setting
    trace = trainer_trace("meta", run.reserve_limit, warm=not run.fresh_process, more_stand_ins=stand_ins,
                          host_values=host_values)

    quantization = run.adapter.quantization if run.adapter else None

    def base():
        return fresh_base_model(config_key(config), run.precision, meta_attention(run.attn_implementation),
                                quantization)

    with refusals_are_crashes():
        if not run.fresh_process:
            trainer = make_trainer(base(), setting, trace)
        elif quantization:  # from_pretrained's load of a 4-bit checkpoint, then the trainer
            skeleton = base()
            trainer = trace.record(lambda: make_trainer(loaded_from_checkpoint(skeleton, trace.tracker), setting,
                                                        trace))
        else:  # a build from the config on the device
            trainer = trace.record(lambda: make_trainer(base(), setting, trace))
    result = simulate_run(step_run(trainer, run.seq, run.precision, run.checkpointing, "meta"), trace=trace)
    if run.adapter is not None:
        from pipeline.training.adapters import trainable_parameters

        result["trainable_parameters"] = trainable_parameters(trainer.model)
    return estimate_of(result, start)


def meta_sft_trainer(model, setting: Setting, precision: str, batch: int, seq: int, device_type: str):
    """SFTTrainer with `pipeline.training.sft.sft_arguments` for the simulated device (`parts.device_arguments`),
    the model left where it is, its inputs placed on `device_type`."""
    import tempfile

    import datasets
    from trl import SFTConfig, SFTTrainer

    from pipeline.inputs.modeling import vocabulary_size
    from pipeline.simulate.clients.parts import device_arguments, on_simulated_device, simulated_on
    from pipeline.training.sft import peft_config, sft_arguments, tokenizer, train_dataset

    MetaSFTTrainer, MetaSFTConfig = on_simulated_device(SFTTrainer, SFTConfig)
    datasets.disable_progress_bars()  # the dataset's preparation, on stderr
    vocab = vocabulary_size(model)
    args = sft_arguments(setting, precision, batch, seq, tempfile.mkdtemp(prefix="avp-simsft-"), MetaSFTConfig,
                         **device_arguments(setting, model))
    trainer = MetaSFTTrainer(model=model, args=args, processing_class=tokenizer(vocab),
                             train_dataset=train_dataset(setting, vocab, batch, seq),
                             peft_config=peft_config(setting))
    simulated_on(trainer, device_type, setting)
    return trainer


class SFTRun(TrainerRun):
    """`TrainerRun` with an SFTTrainer: the micro-batches are its prepared dataset's rows through its collator."""

    fused_head = True
    # of the prepared dataset, those the Trainer keeps (`seq_lengths`: the documents of a packed row)
    columns = ("input_ids", "labels", "completion_mask", "seq_lengths")

    def __init__(self, trainer, seq_len: int, precision: str, gradient_checkpointing: bool, device_type: str):
        super().__init__(trainer, seq_len, precision, gradient_checkpointing, device_type)
        self.row = 0

    def context(self):
        """Padding-free batches' token count (`torch.tensor(n, device=...)`, logged) made as CUDA makes it. Only
        there: other runs' `torch.tensor(..., device=...)` stay uncounted, as the CPU reference runs of the tests
        leave them (512 bytes each in CUDA's small pool)."""
        if self.device_type != "meta" or not getattr(self.trainer, "padding_free", False):
            return super().context()
        from pipeline.simulate.clients.parts import host_tensors

        return host_tensors()

    def micro_batch(self) -> dict:
        """The next B rows of the prepared dataset (the columns the Trainer keeps), collated on the host
        (not counted), then on the device: one counted copy each, with its host values on meta."""
        from torch.utils._python_dispatch import _disable_current_modes

        from pipeline.simulate.values.shadows import shadowed

        dataset = self.trainer.train_dataset
        columns = [c for c in self.columns if c in dataset.column_names]
        rows = [{c: dataset[i][c] for c in columns} for i in range(self.row, self.row + self.batch_size)]
        self.row = (self.row + self.batch_size) % len(dataset)
        with _disable_current_modes():
            batch = self.trainer.data_collator(rows)
        return {key: shadowed(value, self.device_type) if hasattr(value, "device") else value
                for key, value in batch.items()}

