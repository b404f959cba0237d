"""What GRPO and RLOO add to a Trainer run (`Setting.rollout`, `Run.rollout`): the number of completions per prompt,
their length, the KL coefficient and the rest of GRPOConfig / RLOOConfig that moves memory, by TRL's names. A
value left None is TRL's default for the client (`Rollout.defaults`)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields

from pipeline.core.errors import UserError
from pipeline.core.text import short

LOSS_TYPES = {"grpo": ("grpo", "dapo", "dr_grpo", "bnpo", "cispo", "sapo", "luspo", "vespo"), "rloo": ()}
VLLM_MODES = ("colocate", "server")
MAX_GENERATIONS = 1024
MAX_COMPLETION = 1 << 17
# The prompt length asked when none is given: GRPOConfig's max_prompt_length default before TRL 1 removed the key
# (prompts are now as long as the dataset's).
DEFAULT_PROMPT_LENGTH = 512


@dataclass(frozen=True)
class Rollout:
    """What GRPO and RLOO add to a Trainer run, by their GRPOConfig / RLOOConfig names; each None is TRL's
    default (grpo: 8 generations, beta 0.0, loss dapo; rloo: 2 generations, beta 0.05; both 512 completion
    tokens, one step per generation, one iteration)."""

    num_generations: int | None = None
    max_completion_length: int | None = None
    beta: float | None = None
    steps_per_generation: int | None = None
    num_iterations: int | None = None
    loss_type: str | None = None
    use_vllm: bool = False
    vllm_mode: str | None = None
    vllm_gpu_memory_utilization: float | None = None
    # generation with the KV cache, as a checkpoint's generation config has it (`training.grpo.generation_cache`);
    # False only in rows measured before the cache was switched on (their `use_cache` column)
    use_cache: bool | None = None

    @classmethod
    def of(cls, args: dict, label: str, client: str) -> Rollout:
        """The rollout keys of a GRPOConfig / RLOOConfig (a parsed file or the API's arguments); one line for a bad
        value."""
        given = {}
        for key, limit in (("num_generations", MAX_GENERATIONS), ("max_completion_length", MAX_COMPLETION),
                           ("steps_per_generation", 4096), ("num_iterations", 64)):
            value = args.get(key)
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= limit:
                    raise UserError(f"{label}: {key} must be a whole number from 1 to {limit:,}, not {short(value)}")
                given[key] = value
        if given.get("num_generations") == 1:
            raise UserError(f"{label}: num_generations must be at least 2 ({client.upper()} compares the completions "
                            "of one prompt; TRL refuses 1)")
        beta = args.get("beta")
        if beta is not None:
            if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not math.isfinite(beta) \
                    or not 0 <= beta <= 1e6:
                raise UserError(f"{label}: beta must be a number from 0, not {short(beta)}")
            given["beta"] = float(beta)
        loss = args.get("loss_type")
        if loss is not None:
            if client == "rloo" or loss not in LOSS_TYPES["grpo"]:
                allowed = ", ".join(LOSS_TYPES["grpo"]) if client == "grpo" else "none (RLOO has no loss_type)"
                raise UserError(f"{label}: loss_type {short(loss)} is not one of {allowed}")
            given["loss_type"] = loss
        use_vllm = args.get("use_vllm", False)
        if not isinstance(use_vllm, bool):
            raise UserError(f"{label}: use_vllm must be true or false, not {short(use_vllm)}")
        mode = args.get("vllm_mode")
        if mode is not None and mode not in VLLM_MODES:
            raise UserError(f"{label}: vllm_mode must be colocate or server, not {short(mode)}")
        share = args.get("vllm_gpu_memory_utilization")
        if share is not None:
            if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share < 1:
                raise UserError(f"{label}: vllm_gpu_memory_utilization must be a fraction between 0 and 1, "
                                f"not {short(share)}")
            given["vllm_gpu_memory_utilization"] = float(share)
        return cls(use_vllm=use_vllm, vllm_mode=mode, use_cache=True, **given)

    def defaults(self, client: str) -> Rollout:
        """The rollout with TRL's defaults of `client` filled in (what the run has)."""
        base = {"grpo": dict(num_generations=8, beta=0.0, loss_type="dapo"),
                "rloo": dict(num_generations=2, beta=0.05)}[client]
        given = {k: v for k, v in asdict(self).items() if v is not None}
        return Rollout(**{**dict(max_completion_length=512, num_iterations=1, use_cache=True), **base, **given})

    def arguments(self) -> dict:
        """The GRPOConfig / RLOOConfig keys given (vLLM's apart: the measurement generates with transformers)."""
        return {key: value for key, value in asdict(self).items()
                if value is not None and not key.startswith("vllm") and key not in ("use_vllm", "use_cache")}

    def to_text(self) -> str | None:
        """The tables' `rollout` cell: JSON of what is given, None for TRL's defaults."""
        given = {key: value for key, value in asdict(self).items() if value not in (None, False)}
        return json.dumps(given, sort_keys=True) if given else None

    @classmethod
    def from_text(cls, text) -> Rollout | None:
        if not isinstance(text, str) or not text:
            return None
        names = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in json.loads(text).items() if key in names})
