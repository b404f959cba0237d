"""The standard training step (docs/definitions.md), defined once for the measurement on a GPU
(`pipeline.measure.point`) and the simulator (`pipeline.simulate`): what varies within one process (the
`Setting`), the optimizer, the training mode, the token ids and the loss of each loop variant.

    loss = model(input_ids=ids, labels=ids).loss; loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)

three times, ids uniform over the vocabulary, AdamW (or SGD with momentum) over all parameters.
The blog's own loop (`variant="blog"`) is the second, named variant: eval mode, the config's
use_cache, ids below 100, loss = mean(logits), zero_grad() without set_to_none.

A `Setting` also names the client that runs the steps (`loop`: the step above; `trainer`:
transformers.Trainer; `sft`: TRL's SFTTrainer, see pipeline.measure.clients), its optimizer by
transformers name (`optim`), the gradient accumulation (micro-batches per optimizer step, the Trainer
clients' only), the adapters (`adapter`: LoRA or QLoRA, pipeline.training.adapters; None for full
fine-tuning), Liger's kernels (`liger_kernel`: `use_liger_kernel=True` of the Trainer clients), the
share of positions that carry a label (`completion_share`, SFTTrainer's prompt-completion data with
`completion_only_loss`; 1.0 everywhere else) and, on several GPUs, the sharding the client's arguments
launch (`sharding`: `pipeline.training.sharding.sharding_arguments`; None on one GPU). The optimizer
takes the parameters that require gradients: all of them, or the adapters' on a frozen base.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from pipeline.training.adapters import ADAPTER_COLUMNS, AdapterSpec
from pipeline.training.hyperparameters import Hyperparameters
from pipeline.training.packing import Packing
from pipeline.training.rollout import Rollout
from pipeline.core.errors import UserError
from pipeline.inputs.modeling import vocabulary_size
from pipeline.core.vocabulary import (CLIENTS, OPTIM_OF_LOOP_OPTIMIZER, OPTIMIZERS, OPTIMS, SHARDINGS, TRAINER_CLIENTS,
                                      ZERO_SHARDINGS,
                                      ROLLOUT_CLIENTS, TRL_CLIENTS, VARIANTS, check_choice, check_positive_int, precision_mode)

STEPS = 3
BLOG_ID_RANGE = 100  # the blog's ids: torch.randint(0, 100, (B, L))
LEARNING_RATE = 1e-3  # AdamW's default; the value changes no memory


TRAINER_DEFAULT_OPTIM = "adamw_torch_fused"  # TrainingArguments.optim's default (transformers 5.17; SFTConfig's too)
# What SFTTrainer turns on by default that the other clients leave off (SFTConfig of trl 1.16).
SFT_DEFAULT_CHECKPOINTING = True


@dataclass(frozen=True)
class Setting:
    """What varies within one process: the client, the loop variant, the optimizer, checkpointing,
    gradient accumulation, adapters, Liger's kernels and the completion share.

    `optimizer` is the loop's (adamw, sgd), `optim` the transformers name: for the loop it follows
    from `optimizer` (None where no name is exact), for the Trainer clients (trainer, sft, dpo) it is the
    choice (default adamw_torch_fused) and `optimizer` is None.
    """

    variant: str = "standard"
    optimizer: str | None = None  # the loop's default: adamw
    gradient_checkpointing: bool = False
    client: str = "loop"
    optim: str | None = None
    gradient_accumulation: int = 1
    adapter: AdapterSpec | None = None
    liger_kernel: bool = False
    completion_share: float = 1.0
    sharding: str | None = None  # several GPUs (vocabulary.SHARDINGS); None: one GPU
    deepspeed: str | None = None  # zero1-3: the DeepSpeed config's JSON text (`training.zero`)
    # the Trainer clients' optimizer and schedule numbers of a training file (`training.hyperparameters`)
    hyperparameters: Hyperparameters = Hyperparameters()
    rollout: Rollout | None = None  # grpo, rloo: their generation's settings (`training.rollout`)
    packing: Packing | None = None  # sft: packed or padding-free batches (`training.packing`); None: B x L rows

    def __post_init__(self):
        if self.client == "loop":
            optimizer = self.optimizer or "adamw"
            object.__setattr__(self, "optimizer", optimizer)
            if self.optim is None:
                object.__setattr__(self, "optim", OPTIM_OF_LOOP_OPTIMIZER.get(optimizer))
        elif self.client in TRAINER_CLIENTS and self.optim is None:
            object.__setattr__(self, "optim", TRAINER_DEFAULT_OPTIM)
        if self.client in ROLLOUT_CLIENTS and self.rollout is None:
            object.__setattr__(self, "rollout", Rollout())
        share = self.completion_share
        if isinstance(share, int) and not isinstance(share, bool) and 0 < share <= 1:  # 1 is 1.0 (the key's value)
            object.__setattr__(self, "completion_share", float(share))

    @classmethod
    def from_row(cls, row: dict) -> Setting:
        """The setting of a peak-table row; rows written before the client columns are the loop's,
        rows written before the Liger and completion columns ran without Liger on every position."""
        client = row.get("client") or "loop"
        share = row.get("completion_share")
        return cls(row.get("variant") or "standard", row.get("optimizer"), bool(row.get("gradient_checkpointing")),
                   client, row.get("optim") if client != "loop" else None, row.get("gradient_accumulation") or 1,
                   AdapterSpec.from_row(row), bool(row.get("liger_kernel") or False),
                   1.0 if share is None or share != share else float(share), row.get("sharding") or None,
                   row.get("deepspeed") or None, Hyperparameters.from_text(row.get("hyperparameters")),
                   Rollout.from_text(row.get("rollout")), Packing.from_text(row.get("packing")))

    def check(self) -> None:
        check_choice("client", self.client, CLIENTS)
        check_choice("variant", self.variant, VARIANTS)
        if not isinstance(self.gradient_checkpointing, bool):
            raise UserError(f"gradient_checkpointing must be true or false, not {self.gradient_checkpointing!r}")
        if self.variant == "blog" and self.gradient_checkpointing:
            raise UserError("the blog variant runs in eval mode, where gradient checkpointing does nothing")
        check_positive_int("gradient_accumulation", self.gradient_accumulation)
        if self.adapter is not None and not isinstance(self.adapter, AdapterSpec):
            raise UserError(f"adapter must be an AdapterSpec, not {type(self.adapter).__name__}")
        if self.adapter is not None and self.variant != "standard":
            raise UserError("adapters (lora, qlora) train with the standard variant only")
        if self.client == "loop":
            check_choice("optimizer", self.optimizer, OPTIMIZERS)
            if self.optim != OPTIM_OF_LOOP_OPTIMIZER[self.optimizer]:
                raise UserError(f"optim is the trainer client's; the loop takes optimizer ({', '.join(OPTIMIZERS)})")
            if self.gradient_accumulation != 1:
                raise UserError(f"gradient_accumulation other than 1 needs a Trainer client ({', '.join(TRAINER_CLIENTS)})")
        else:
            if self.optimizer is not None:
                raise UserError(f"optimizer is the loop client's; the {self.client} client takes optim "
                                f"({', '.join(OPTIMS)})")
            check_choice("optim", self.optim, OPTIMS)
            if self.variant != "standard":
                raise UserError(f"the {self.client} client runs the standard variant only")
        if not isinstance(self.liger_kernel, bool):
            raise UserError(f"liger_kernel must be true or false, not {self.liger_kernel!r}")
        if self.liger_kernel and self.client not in TRAINER_CLIENTS:
            raise UserError(f"liger_kernel is use_liger_kernel of the Trainer clients ({', '.join(TRAINER_CLIENTS)}), "
                            f"not of the {self.client} client")
        check_share(self.completion_share)
        if self.sharding is not None:
            check_choice("sharding", self.sharding, SHARDINGS)
        if (self.sharding in ZERO_SHARDINGS) != (self.deepspeed is not None):
            raise UserError("a DeepSpeed config goes with sharding zero1, zero2 or zero3, and they with one")
        if not isinstance(self.hyperparameters, Hyperparameters):
            raise UserError(f"hyperparameters must be a Hyperparameters, not {type(self.hyperparameters).__name__}")
        if self.hyperparameters != Hyperparameters() and self.client not in TRAINER_CLIENTS:
            raise UserError(f"a training file's optimizer and schedule numbers are the Trainer clients' "
                            f"({', '.join(TRAINER_CLIENTS)}), not the {self.client} client's")
        if self.rollout is not None and self.client not in ROLLOUT_CLIENTS:
            raise UserError(f"num_generations, max_completion_length, beta and the rest of a rollout are GRPO's and "
                            f"RLOO's ({', '.join(ROLLOUT_CLIENTS)}), not the {self.client} client's")
        if self.packing is not None and self.client != "sft":
            raise UserError(f"packing and padding_free are SFTTrainer's (client sft), not the {self.client} client's")
        if self.completion_share != 1.0 and self.client not in TRL_CLIENTS:
            raise UserError(f"completion_share is TRL's trainers' ({', '.join(TRL_CLIENTS)}), not the {self.client} "
                            "client's")

    @property
    def blog(self) -> bool:
        return self.variant == "blog"

    def adapter_columns(self) -> dict:
        """lora_r, lora_alpha, lora_targets, quantization, lora_dropout (None without adapters)."""
        if self.adapter is None:
            return dict.fromkeys(ADAPTER_COLUMNS)
        return self.adapter.columns()


def check_share(share) -> None:
    """A completion share is a number in (0, 1]: the fraction of each sequence's positions that carry a label."""
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
        raise UserError(f"completion_share must be a number in (0, 1], not {share!r}")


def mixed_precision_args(precision: str) -> dict:
    """TrainingArguments' (and SFTConfig's) bf16 and fp16 of a precision: its autocast's dtype, named."""
    autocast_name = precision_mode(precision).autocast
    return {"bf16": autocast_name == "bf16", "fp16": autocast_name == "fp16"}


def trainable(params) -> list:
    """The parameters the optimizer takes: those that require gradients."""
    return [p for p in params if p.requires_grad]


def make_optimizer(params, setting: Setting, foreach: bool | None = None):
    """AdamW, or SGD with momentum 0.9; `foreach=None` is torch's default for the device (foreach
    on CUDA), which the simulator must name because meta tensors have no default. Under tensor parallelism
    the sharded weights (DTensors) and the replicated ones (the norms: plain tensors) are two parameter
    groups: one foreach kernel takes tensors of one kind."""
    import torch

    params = parameter_groups(list(params))
    if setting.optimizer == "sgd":
        return torch.optim.SGD(params, lr=LEARNING_RATE, momentum=0.9, foreach=foreach)
    return torch.optim.AdamW(params, lr=LEARNING_RATE, foreach=foreach)


def parameter_groups(params: list):
    """`params`, or two groups when DTensors and plain tensors mix (tensor parallelism's sharded and replicated
    weights)."""
    sharded = [p for p in params if hasattr(p, "_local_tensor")]
    if not sharded or len(sharded) == len(params):
        return params
    return [{"params": sharded}, {"params": [p for p in params if not hasattr(p, "_local_tensor")]}]


def set_training_mode(model, setting: Setting) -> None:
    """Checkpointing on or off, and train mode (eval for the blog's loop, as from_pretrained leaves it)."""
    if setting.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    elif getattr(model, "is_gradient_checkpointing", False):
        model.gradient_checkpointing_disable()
    model.train(not setting.blog)


def token_ids(model, batch: int, seq: int, setting: Setting, device):
    import torch

    vocab = BLOG_ID_RANGE if setting.blog else vocabulary_size(model)
    return torch.randint(0, vocab, (batch, seq), device=device)


def training_loss(model, ids, setting: Setting, use_cache: bool = True):
    """The loss of the loop variant (the blog's forward keeps the config's use_cache)."""
    import torch

    if setting.blog:
        return torch.mean(model(ids, use_cache=use_cache).logits)
    return model(input_ids=ids, labels=ids).loss


def zero_grad(optimizer, setting: Setting) -> None:
    """The standard step asks for set_to_none=True; the blog's plain zero_grad() is the same call
    (torch's default since 2.0): the gradients are freed, not zeroed, in both variants."""
    optimizer.zero_grad(set_to_none=True)


def autocast_dtype(precision: str):
    """The torch dtype of the precision's autocast (`vocabulary.Precision.autocast`), None without autocast."""
    import torch

    return {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision_mode(precision).autocast]


def autocast(precision: str, device: str):
    """The autocast modes (amp-bf16, amp-fp16, bf16-autocast): the forward and the loss under bf16 or fp16
    autocast (backward and optimizer outside)."""
    import torch

    dtype = autocast_dtype(precision)
    return contextlib.nullcontext() if dtype is None else torch.autocast(device, dtype=dtype)


def grad_scaler(precision: str, device: str):
    """amp-fp16's gradient scaler (torch.amp.GradScaler, its defaults); None in the other modes."""
    import torch

    return torch.amp.GradScaler(device) if precision_mode(precision).scaler else None
