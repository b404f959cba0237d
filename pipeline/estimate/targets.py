"""What is estimated (`Target`): from a model id, a config (path, dict or transformers config) or a
parameter count; the formula's target is read from config facts without torch or transformers."""

from __future__ import annotations

import math
import numbers
from pathlib import Path

from pipeline.inputs.checks import check_config_facts, plain_facts
from pipeline.inputs.configs import read_config_file
from pipeline.core.errors import UserError
from pipeline.core.text import first_line, short
from pipeline.estimate.estimators import ESTIMATORS, config_dict
from pipeline.training.values import Target


def formula_target(model=None, config=None) -> Target:
    """The target of the formula: config facts and N in closed form, without building (or importing) a model."""
    from pipeline.formulas.features import parameter_count, read_facts

    if model is not None:
        from pipeline.inputs.configs import model_facts

        config, label = model_facts(model)[0], model
    elif isinstance(config, (str, Path)):
        config, label = read_config_file(config), str(config)
    else:
        config, label = plain_facts(config_dict(config)), "config"
    check_config_facts(config, label)
    facts = read_facts(config)
    if not facts.hidden or not facts.layers or not facts.vocab:
        raise UserError(f"{label}: cannot read the model's shape ({', '.join(facts.unread)})")
    n, active = parameter_count(facts)
    return Target(n, str(config.get("_name_or_path") or label), config, active)


def resolve_config(model=None, config=None):
    """(model id, transformers config) from a model id, a config.json path, a dict of its facts, or a config."""
    from pipeline.inputs.configs import config_from_dict, resolve_model
    from pipeline.inputs.registry import check_shape_facts

    if model is not None and config is not None:
        raise UserError("give one of model and config, not both")
    if model is not None:
        resolved = resolve_model(model_id=model)
        return resolved.model_id, resolved.config
    if isinstance(config, (str, Path)):
        config, label = read_config_file(config), str(Path(config))
    else:
        label = "config"
    if isinstance(config, dict):
        built = config_from_dict(config, label)  # checks model_type first
        check_shape_facts(config, label)
        return str(config.get("_name_or_path") or label), built
    if not (hasattr(config, "to_dict") and getattr(config, "model_type", None)):
        raise UserError(f"config must be a config.json path, its dict or a transformers config, not "
                        f"{type(config).__name__}")
    return str(getattr(config, "_name_or_path", "") or "config"), config


def count_parameters(config) -> tuple[int, int, object]:
    """(N, parameters active per token, the config as the build left it) of the model built from its
    config on the meta device. Counted once per config in a process (the server's questions about one
    model build it once); later calls get the counts and a copy of the config as that build left it
    (transformers records the build's dtype on it, and the simulator's model cache keys on the config)."""
    import copy

    from pipeline.inputs.modeling import build_model, parameter_counts
    from pipeline.simulate.predict import config_key

    key = config_key(config)
    if key not in COUNTED:
        try:
            counts = parameter_counts(build_model(config, "meta"), config)
        except Exception as exc:  # noqa: BLE001 - a config transformers cannot build is bad input
            raise UserError(f"config cannot be built: {first_line(exc, 200)}") from None
        if len(COUNTED) >= 64:
            COUNTED.clear()
        COUNTED[key] = int(counts["parameters"]), int(counts["active_parameters"]), copy.deepcopy(config)
    n, active, built = COUNTED[key]
    return n, active, copy.deepcopy(built)


COUNTED = {}  # config_key -> (N, active, the config after the build): count_parameters' answers


MAX_PARAMETERS = 10**14  # 100 trillion: far beyond any model


def parse_parameter_count(params, name: str = "params") -> int:
    """N from an integer (numpy's too, never a bool) or text such as '1543714304' or '1.5e9': a
    positive whole number of at most MAX_PARAMETERS."""
    if isinstance(params, bool) or not isinstance(params, (numbers.Real, str)):
        raise UserError(f"{name} must be a number, not {short(params)}")
    if isinstance(params, str) and params.strip().isdigit():
        value = int(params)  # exact, even beyond float precision
    else:
        try:
            value = float(params)
        except (TypeError, ValueError, OverflowError):
            raise UserError(f"{name} {short(params)} is not a number") from None
        if not math.isfinite(value) or value != int(value):
            raise UserError(f"{name} {short(params)} must be a positive whole number")
        value = int(value)
    if not 0 < value <= MAX_PARAMETERS:
        raise UserError(f"{name} {short(params)} must be a positive whole number of at most {MAX_PARAMETERS:.0e}")
    return value


def declared_weights_dtype(model=None, config=None) -> str | None:
    """The weights' dtype (bf16 | fp32) that the model's config declares (`dtype`, or the older
    `torch_dtype`: what from_pretrained loads by default), None when it names none or another one."""
    from pipeline.core.vocabulary import WEIGHTS_DTYPE_OF_TORCH_NAME

    facts = None
    if model is not None:
        from pipeline.core.paths import CONFIGS
        from pipeline.inputs.configs import read_config_records

        record = read_config_records(CONFIGS).get(model) if Path(CONFIGS).is_file() else None
        facts = (record or {}).get("config")
    elif isinstance(config, (str, Path)):
        facts = read_config_file(config)
    elif isinstance(config, dict):
        facts = config
    elif config is not None:
        facts = {name: getattr(config, name, None) for name in ("dtype", "torch_dtype")}
    if not isinstance(facts, dict):
        return None
    named = facts.get("dtype") or facts.get("torch_dtype")
    return WEIGHTS_DTYPE_OF_TORCH_NAME.get(str(named)) if named is not None else None


def resolve_target(model=None, config=None, params=None, method="heuristic", active_params=None) -> Target:
    if sum(x is not None for x in (model, config, params)) != 1:
        raise UserError("give exactly one of model, config and params")
    if params is not None:
        if ESTIMATORS[method].needs_config:
            raise UserError(f"method {method!r} needs the model's shape: give a model or a config, not params")
        n = parse_parameter_count(params)
        active = parse_parameter_count(active_params, "active params") if active_params is not None else None
        if active is not None and active > n:
            raise UserError(f"active params {active} exceed params {n}")
        return Target(n, active_parameters=active)
    if active_params is not None:
        raise UserError("active params go with params; a model or config gives its own")
    if ESTIMATORS[method].reads_facts_only:
        return formula_target(model, config)
    model_id, config = resolve_config(model, config)
    n, active, built = count_parameters(config)
    return Target(n, model_id, built, active)
