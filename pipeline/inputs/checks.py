"""The one validation of a config's facts, before any work and whatever reads them next (the
registry, `--config` files, configs.json records, the Python API's dicts; every estimator method):

- `model_type`: a short text;
- each shape fact (under any alias of `inputs.aliases`, in the config or a nested text_config):
  an integer (not a string, float, bool or NaN) within the limits below; so is each size of the
  token mixers beside attention (`MIXER_LIMITS`: linear attention, short convolutions, Mamba-2);
- the relations a forward needs: attention heads a multiple of key/value heads, the hidden size a
  multiple of the heads where no head_dim is given, experts per token at most the experts.

Pure Python (no transformers): the formula answers without it. Building the config then runs
transformers' own validation (`inputs.configs.config_from_dict`), whose errors become one line too.
"""

from __future__ import annotations

import numbers

from pipeline.core.errors import UserError
from pipeline.core.text import short
from pipeline.inputs.aliases import names_of

MAX_MODEL_TYPE = 64  # characters
# The largest value a shape fact may take: a few times the largest public model's, small enough
# that building or simulating the model stays within minutes and memory (README, "Bad input").
LIMITS = {"layers": 1024, "hidden": 131_072, "heads": 4096, "kv_heads": 4096, "head_dim": 8192,
          "intermediate": 1_048_576, "vocab": 4_194_304, "experts": 4096, "top_k": 4096,
          "moe_intermediate": 1_048_576, "positions": 1 << 24, "context": 1 << 24}
# Sizes of the token mixers of hybrid models and of per-layer extras, by their config.json names (each checked
# where given): heads and widths like the attention's, kernels and chunks small, states like a head.
MIXER_LIMITS = {**{name: 4096 for name in ("linear_num_key_heads", "linear_num_value_heads", "mamba_num_heads",
                                            "mamba_n_heads", "n_groups", "mamba_n_groups", "index_n_heads")},
                **{name: 8192 for name in ("linear_key_head_dim", "linear_value_head_dim", "mamba_head_dim",
                                            "ssm_state_size", "mamba_d_state", "global_head_dim", "index_head_dim")},
                **{name: 131_072 for name in ("mamba_d_ssm", "hidden_size_per_layer_input", "shared_intermediate_size",
                                               "moe_shared_expert_intermediate_size", "block_ff_dim")},
                **{name: 1024 for name in ("linear_conv_kernel_dim", "conv_kernel", "mamba_d_conv", "conv_L_cache",
                                            "num_kv_shared_layers")},
                **{name: 65_536 for name in ("chunk_size", "mamba_chunk_size")}}
MIXER_MAY_BE_ZERO = {"num_kv_shared_layers", "hidden_size_per_layer_input", "shared_intermediate_size"}
# Facts that may be 0 (no experts, no separate expert width).
MAY_BE_ZERO = {"experts", "top_k", "moe_intermediate", "head_dim"}


def plain_facts(facts):
    """A copy of config facts with numpy's numbers as Python's (what JSON would have given)."""
    if isinstance(facts, dict):
        return {key: plain_facts(value) for key, value in facts.items()}
    if isinstance(facts, (list, tuple)):
        return [plain_facts(value) for value in facts]
    if isinstance(facts, numbers.Integral) and not isinstance(facts, bool) and type(facts).__name__ != "bool_":
        return int(facts)
    if isinstance(facts, numbers.Real) and not isinstance(facts, (bool, int, float)):
        return float(facts)
    return facts


def check_config_facts(facts, label: str = "config") -> None:
    """UserError naming the first fact of `facts` (a config.json dict) that is wrong."""
    if not isinstance(facts, dict):
        raise UserError(f"{label}: a config is a JSON object, not {type(facts).__name__}")
    model_type = facts.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise UserError(f"{label}: field 'model_type': missing or not a text ({short(model_type)})")
    if len(model_type) > MAX_MODEL_TYPE or not model_type.isprintable():
        raise UserError(f"{label}: field 'model_type': {short(model_type, 40)} is not a model type")
    text = facts.get("text_config")
    if isinstance(text, dict):
        check_config_facts({"model_type": model_type, **text}, f"{label}: text_config")
    values = {fact: _fact(facts, fact, model_type, label) for fact in LIMITS}
    for name, limit in MIXER_LIMITS.items():
        if facts.get(name) is not None:
            _within(facts[name], name, 0 if name in MIXER_MAY_BE_ZERO else 1, limit, label)
    _check_relations(values, label)


def _fact(facts: dict, fact: str, model_type: str, label: str):
    """The fact's value (None when unstated), checked: an integer within its limit."""
    for source in (facts, *(v for k, v in facts.items() if isinstance(v, dict) and k != "text_config")):
        for name in names_of(fact, model_type):
            if name in source and source[name] is not None:
                return _checked(source[name], name, fact, label)
    return None


def _checked(value, name: str, fact: str, label: str) -> int:
    return _within(value, name, 0 if fact in MAY_BE_ZERO else 1, LIMITS[fact], label)


def _within(value, name: str, low: int, high: int, label: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserError(f"{label}: field {name!r} must be an integer, not {short(value)}")
    if not low <= value <= high:
        raise UserError(f"{label}: field {name!r} is {short(value)}; it must be between {low} and {high:,}")
    return value


def _check_relations(values: dict, label: str) -> None:
    heads, kv_heads, hidden = values["heads"], values["kv_heads"], values["hidden"]
    if heads and kv_heads and heads % kv_heads:
        raise UserError(f"{label}: {heads} attention heads are not a multiple of {kv_heads} key/value heads")
    if heads and hidden and not values["head_dim"] and hidden % heads:
        raise UserError(f"{label}: hidden size {hidden} is not a multiple of {heads} attention heads "
                        "(and no head_dim is given)")
    experts, top_k = values["experts"], values["top_k"]
    if experts and top_k and top_k > experts:
        raise UserError(f"{label}: {top_k} experts per token exceed the {experts} experts")
