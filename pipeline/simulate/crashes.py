"""Runs that would crash: the simulator runs the libraries' own code (transformers' Trainer and its arguments, TRL,
accelerate, DeepSpeed), so where that code refuses the user's setting before the first step (a DeepSpeed
scheduler's warmup of 0 steps, a config value that disagrees with the training arguments, DeepSpeed's own
checks), the real run stops there too. That refusal is the answer: `RunWouldCrash`, one line that says where the
run stops, what the library said, and what to change.

Only a refusal raised by the libraries themselves counts (the innermost frame of the exception is theirs, and it
is a ValueError, AssertionError, TypeError, KeyError, NotImplementedError or DeepSpeed's config error): a failure
of the simulator's own stand-ins stays what it is.
"""

from __future__ import annotations

import contextlib
import re

from pipeline.core.errors import UserError
from pipeline.core.text import short

# the libraries whose checks refuse a user's setting (torch's optimizers: a negative learning rate, betas >= 1)
LIBRARIES = ("deepspeed", "transformers", "accelerate", "trl", "peft", "torch.optim")
REFUSALS = (ValueError, AssertionError, TypeError, KeyError, NotImplementedError)
# a TypeError or KeyError is also how a stand-in called the wrong way fails: only these messages are refusals
NAMED_ONLY = (TypeError, KeyError)
# (pattern of the library's message, what to change): the settings a message points to
HINTS = (
    (r"warmup_num_steps must be a positive integer",
     "set warmup_steps above 0 in the training file (--training-args / --sft-config; below 1 it is a share of "
     "max_steps): the config's \"auto\" warmup is the Trainer's"),
    (r"mismatch TrainingArguments",
     "set those DeepSpeed values to \"auto\", or the training file's to the config's"),
    (r"does not recognize LR scheduler", "the config's scheduler.type: WarmupLR, WarmupDecayLR, WarmupCosineLR, "
                                         "OneCycle, LRRangeTest or a torch.optim.lr_scheduler class"),
    (r"unexpected keyword argument", "a params key of the config's scheduler or optimizer section"),
    (r"Invalid (learning rate|beta parameter|epsilon value|weight_decay value)",
     "the training file's learning_rate, adam_beta1 / adam_beta2, adam_epsilon or weight_decay"),
    (r"Extra inputs are not permitted", "a key DeepSpeed does not know in the config"),
)


class RunWouldCrash(UserError):
    """The real run stops before its first step on this setting (one line: where, why, what to change)."""


@contextlib.contextmanager
def refusals_are_crashes(when: str = "before its first step"):
    """Inside: a refusal raised by the libraries' own code (`refusal`) is `RunWouldCrash`."""
    try:
        yield
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - sorted below: a library's refusal, or anything else as it was
        where = refusal(exc)
        if where is None:
            raise
        raise RunWouldCrash(crash_line(exc, where, when)) from None


def refusal(exc: BaseException) -> str | None:
    """The library module that refused (`deepspeed.runtime.lr_schedules`), or None where the exception is not a
    library's own refusal of a setting."""
    if not isinstance(exc, REFUSALS) and type(exc).__name__ != "DeepSpeedConfigError":
        return None
    traceback = exc.__traceback__
    module = ""
    while traceback is not None:
        module = traceback.tb_frame.f_globals.get("__name__", "")
        traceback = traceback.tb_next
    if not any(module == library or module.startswith(library + ".") for library in LIBRARIES):
        return None
    if "meta" in str(exc).lower():
        return None
    if isinstance(exc, NAMED_ONLY) and not any(re.search(pattern, str(exc)) for pattern, _ in HINTS):
        return None
    return module


def crash_line(exc: BaseException, module: str, when: str) -> str:
    message = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__
    library = {"deepspeed": "DeepSpeed", "trl": "TRL", "peft": "PEFT", "torch": "torch"}.get(module.split(".")[0],
                                                                                       module.split(".")[0])
    hint = next((advice for pattern, advice in HINTS if re.search(pattern, message)), None)
    line = f"the run would stop {when}: {library} ({module}) refuses it: {short(message, 400, quote=False)}"
    return f"{line}; {hint}" if hint else line
