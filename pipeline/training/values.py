"""The values passed between the stages: the run (a training step's shape and settings), the target
(what is estimated) and an estimate (a peak with its components), the same for the estimators, the
simulator, the searches and the validation."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pipeline.core.io import cell
from pipeline.core.vocabulary import ROLLOUT_CLIENTS
from pipeline.training.adapters import AdapterSpec
from pipeline.training.hyperparameters import Hyperparameters
from pipeline.training.packing import Packing
from pipeline.training.rollout import Rollout
from pipeline.core.errors import UserError
from pipeline.formulas.components import optimizer_key
from pipeline.training.layout import Layout
from pipeline.training.step import Setting
from pipeline.core.vocabulary import (MAX_ACCUMULATION, MAX_BATCH, MAX_SEQ, MAX_TOKENS, PRECISIONS, check_bool,
                                      check_choice, check_positive_int, precision_mode)

GIB = 2**30


@dataclass(frozen=True)
class Run:
    """The training step being estimated: its shape and settings. The client (`loop`: the standard
    step; `trainer`: transformers.Trainer; `sft`: TRL's SFTTrainer) takes its optimizer as `optimizer`
    (loop: adamw, sgd) or `optim` (trainer, sft: the TrainingArguments name, default adamw_torch_fused),
    as `pipeline.training.step.Setting`; so are Liger's kernels (`liger_kernel`, trainer and sft) and the
    share of labelled positions (`completion_share`, sft)."""

    batch: int
    seq: int
    precision: str
    optimizer: str | None = None  # the loop's; None: adamw
    checkpointing: bool = False
    attn_implementation: str | None = None  # exact only; None: the library's default
    expandable_segments: bool = False  # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    client: str = "loop"
    optim: str | None = None  # the trainer's; None: adamw_torch_fused
    gradient_accumulation: int = 1  # micro-batches per optimizer step (trainer)
    num_gpus: int = 1  # GPUs of the run; `batch` is per data-parallel rank
    sharding: str | None = None  # ddp, fsdp, fsdp-no-reshard, hsdp (vocabulary.SHARDINGS); None: one GPU
    shard_group: int | None = None  # hsdp: the GPUs one copy of the model is sharded over
    tensor_parallel: int = 1  # GPUs a layer is split over (transformers' tensor-parallel plan)
    adapter: AdapterSpec | None = None  # LoRA / QLoRA on a frozen base; None: full fine-tuning
    # bytes the process may reserve on its GPU (the fit verdict's device): the exact replay gives cached
    # segments back at that edge, as the allocator does after a failed cudaMalloc; None: no edge
    reserve_limit: int | None = None
    variant: str = "standard"  # the loop's: the standard step, or the blog's own loop (vocabulary.VARIANTS)
    liger_kernel: bool = False  # use_liger_kernel=True (trainer, sft)
    completion_share: float = 1.0  # positions with a label (sft's completion_only_loss on prompt-completion data)
    # the process's first training step (a user's script): cuBLAS's workspaces made at their first use, in the
    # middle of the step (exact only: the loop and Trainer clients; several GPUs run a later step); False: an
    # earlier step of the same process made them (a sweep's points after its first)
    fresh_process: bool = True
    # sharding zero1-3: the DeepSpeed config's JSON text (`training.zero`); None: the stage with "auto" elsewhere
    deepspeed: str | None = None
    # a training file's optimizer and schedule numbers (trainer, sft, dpo): DeepSpeed's "auto" values come from
    # them, and whether its scheduler starts
    hyperparameters: Hyperparameters = Hyperparameters()
    # grpo, rloo: completions per prompt, their length, beta and the rest (`training.rollout`); None: TRL's defaults
    rollout: Rollout | None = None
    # sft: packed or padding-free batches (`training.packing`); None: B rows of L tokens
    packing: Packing | None = None

    def __post_init__(self):
        object.__setattr__(self, "batch", check_positive_int("batch", self.batch, MAX_BATCH))
        object.__setattr__(self, "seq", check_positive_int("seq", self.seq, MAX_SEQ))
        if self.batch * self.seq > MAX_TOKENS:
            raise UserError(f"batch x seq = {self.batch * self.seq:,} tokens is more than the {MAX_TOKENS:,} this "
                            "project estimates")
        check_choice("precision", self.precision, PRECISIONS)
        for name in ("checkpointing", "expandable_segments", "fresh_process"):
            object.__setattr__(self, name, check_bool(name, getattr(self, name)))
        object.__setattr__(self, "gradient_accumulation", check_positive_int(
            "gradient_accumulation", self.gradient_accumulation, MAX_ACCUMULATION))
        if self.deepspeed is None and self.client != "loop" and str(self.sharding).startswith("zero"):
            from pipeline.training.zero import STAGES, default_config

            if self.sharding in STAGES:
                object.__setattr__(self, "deepspeed", default_config(self.sharding))
        setting = self.setting
        setting.check()
        object.__setattr__(self, "optimizer", setting.optimizer)
        object.__setattr__(self, "optim", setting.optim)
        object.__setattr__(self, "completion_share", setting.completion_share)
        object.__setattr__(self, "rollout", setting.rollout)
        self.check_sharding()

    def check_sharding(self) -> None:
        layout = Layout(self.num_gpus, self.sharding, self.shard_group, self.tensor_parallel)
        object.__setattr__(self, "num_gpus", layout.num_gpus)
        self.check_deepspeed()
        if precision_mode(self.precision).gathered and (layout.shards < 2 or self.client != "loop"):
            raise UserError(f"precision {self.precision} is FSDP2's mixed precision of the loop: it needs --sharding "
                            "fsdp, fsdp-no-reshard or hsdp over several GPUs (the Trainer clients take bf16 with "
                            "fp32 weights: amp-bf16, which accelerate's FSDP2 runs so)")
        if self.client == "loop" and self.adapter is not None and layout.sharded:
            raise UserError("the loop's sharded step is full fine-tuning; adapters on several GPUs run with the "
                            "trainer, sft and dpo clients")

    def check_deepspeed(self) -> None:
        """sharding zero1-3 runs the Trainer clients with a DeepSpeed config (`training.zero`), which must agree
        with the run (its stage, batch, accumulation and precision)."""
        from pipeline.training import zero

        if self.sharding not in zero.STAGES:
            if self.deepspeed is not None:
                raise UserError("a DeepSpeed config needs sharding zero1, zero2 or zero3 (its stage)")
            return
        if self.client == "loop":
            raise UserError(f"sharding {self.sharding} is DeepSpeed's as the Trainer runs it: use the trainer, sft or "
                            "dpo client")
        zero.check_run(self.deepspeed, self.sharding, self.batch, self.gradient_accumulation, self.num_gpus,
                       precision_mode(self.precision).autocast)

    @property
    def layout(self) -> Layout:
        """The run's GPUs and how they split the work (`training.layout.Layout`)."""
        return Layout(self.num_gpus, self.sharding, self.shard_group, self.tensor_parallel)

    @property
    def setting(self) -> Setting:
        """The run's `pipeline.training.step.Setting` (what the GPU measurement of it runs)."""
        return Setting(self.variant, self.optimizer, self.checkpointing, self.client, self.optim,
                       self.gradient_accumulation, self.adapter, self.liger_kernel, self.completion_share,
                       None if self.client == "loop" else self.sharding, self.deepspeed, self.hyperparameters,
                       self.rollout, self.packing)

    @property
    def optimizer_key(self) -> str:
        """The optimizer as the formulas know it (`pipeline.formulas.components.OPTIMIZER_TERMS`)."""
        return optimizer_key(self.client, self.optimizer, self.optim)

    @classmethod
    def from_row(cls, row, reserve_limit: int | None = None) -> Run:
        """The run of a measured point of a peak table (`training.points`): its client, optimizer,
        adapter, the attention implementation the estimators tell apart (eager, sdpa; else None) and
        whether it was its process's first (`first_in_process`, `training.points.first_in_process`; a
        row without that column: a later point)."""
        client = cell(row, "client") or "loop"
        attention = cell(row, "attn_implementation")
        share = cell(row, "completion_share")
        return cls(int(cell(row, "batch_size")), int(cell(row, "seq_len")), cell(row, "precision"),
                   cell(row, "optimizer") if client == "loop" else None, bool(cell(row, "gradient_checkpointing")),
                   attention if attention in ("eager", "sdpa") else None, client=client,
                   optim=cell(row, "optim") if client != "loop" else None,
                   gradient_accumulation=int(cell(row, "gradient_accumulation") or 1),
                   adapter=AdapterSpec.from_row(row), reserve_limit=reserve_limit,
                   variant=cell(row, "variant") or "standard", liger_kernel=bool(cell(row, "liger_kernel") or False),
                   completion_share=1.0 if share is None else float(share),
                   fresh_process=bool(cell(row, "first_in_process") or False),
                   num_gpus=int(cell(row, "num_gpus") or 1), sharding=cell(row, "sharding") or None,
                   shard_group=None if cell(row, "shard_group") is None else int(cell(row, "shard_group")),
                   tensor_parallel=int(cell(row, "tensor_parallel") or 1), deepspeed=cell(row, "deepspeed") or None,
                   hyperparameters=Hyperparameters.from_text(cell(row, "hyperparameters")),
                   expandable_segments=expandable(cell(row, "alloc_conf")),
                   rollout=rollout_of(row, client), packing=Packing.from_text(cell(row, "packing")))

    def with_batch(self, batch: int) -> Run:
        return replace(self, batch=batch)

    def with_seq(self, seq: int) -> Run:
        return replace(self, seq=seq)


def rollout_of(row, client: str) -> Rollout | None:
    """A row's rollout; where its JSON does not say whether generation used the KV cache (rows measured before
    it did), the row's `use_cache` column says."""
    rollout = Rollout.from_text(cell(row, "rollout"))
    if client not in ROLLOUT_CLIENTS or (rollout is not None and rollout.use_cache is not None):
        return rollout
    return replace(rollout or Rollout(), use_cache=bool(cell(row, "use_cache") or False))


def expandable(alloc_conf) -> bool:
    """Whether a PYTORCH_CUDA_ALLOC_CONF text (a table's `alloc_conf` cell) turns expandable segments on."""
    if not isinstance(alloc_conf, str) or not alloc_conf:
        return False
    from pipeline.training.alloc_conf import read_alloc_conf

    return read_alloc_conf(alloc_conf)["expandable_segments"]


@dataclass
class Target:
    """What is estimated: a parameter count, and the config when one was given."""

    parameters: int
    model_id: str | None = None
    config: object = None
    active_parameters: int | None = None  # per token (MoE); None: all of them

    @property
    def active(self) -> int:
        return self.parameters if self.active_parameters is None else self.active_parameters

    @property
    def source(self) -> str:
        return "given" if self.config is None else "config (built on the meta device)"


@dataclass
class Estimate:
    """One estimator's answer: the peak, its components (bytes) and what the method adds to the answer."""

    peak_bytes: float
    components: dict | None
    details: dict = field(default_factory=dict)
    reserved_bytes: float | None = None  # torch.cuda.max_memory_reserved(), default allocator settings
    reserved_expandable_bytes: float | None = None  # the same with expandable segments

    def reserved(self, expandable: bool) -> float:
        return self.reserved_expandable_bytes if expandable else self.reserved_bytes
