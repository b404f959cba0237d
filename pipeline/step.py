"""The standard training step (docs/definitions.md), defined once for the measurement on a GPU
(`pipeline.memory`) and the simulator (`pipeline.simulate`): what varies within one process (the
`Setting`), the optimizer, the training mode, the token ids and the loss of each loop variant.

    loss = model(input_ids=ids, labels=ids).loss; loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)

three times, ids uniform over the vocabulary, AdamW (or SGD with momentum) over all parameters.
The blog's own loop (`variant="blog"`) is the second, named variant: eval mode, the config's
use_cache, ids below 100, loss = mean(logits), zero_grad() without set_to_none.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from pipeline.errors import UserError
from pipeline.modeling import vocabulary_size
from pipeline.vocabulary import OPTIMIZERS, VARIANTS, check_choice

STEPS = 3
BLOG_ID_RANGE = 100  # the blog's ids: torch.randint(0, 100, (B, L))
LEARNING_RATE = 1e-3  # AdamW's default; the value changes no memory


@dataclass(frozen=True)
class Setting:
    """What varies within one process: the loop, the optimizer and checkpointing."""

    variant: str = "standard"
    optimizer: str = "adamw"
    gradient_checkpointing: bool = False

    def check(self) -> None:
        check_choice("variant", self.variant, VARIANTS)
        check_choice("optimizer", self.optimizer, OPTIMIZERS)
        if not isinstance(self.gradient_checkpointing, bool):
            raise UserError(f"gradient_checkpointing must be true or false, not {self.gradient_checkpointing!r}")
        if self.variant == "blog" and self.gradient_checkpointing:
            raise UserError("the blog variant runs in eval mode, where gradient checkpointing does nothing")

    @property
    def blog(self) -> bool:
        return self.variant == "blog"


def make_optimizer(params, setting: Setting, foreach: bool | None = None):
    """AdamW, or SGD with momentum 0.9; `foreach=None` is torch's default for the device (foreach
    on CUDA), which the simulator must name because meta tensors have no default."""
    import torch

    if setting.optimizer == "sgd":
        return torch.optim.SGD(params, lr=LEARNING_RATE, momentum=0.9, foreach=foreach)
    return torch.optim.AdamW(params, lr=LEARNING_RATE, foreach=foreach)


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


def autocast(precision: str, device: str):
    """amp-bf16: the forward and the loss under bf16 autocast (backward and optimizer outside)."""
    import torch

    if precision == "amp-bf16":
        return torch.autocast(device, dtype=torch.bfloat16)
    return contextlib.nullcontext()
