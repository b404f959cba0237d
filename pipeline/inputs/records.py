"""A model as the measurement and its plans see it: a configs.json record plus the facts read from
its config (`ModelRecord`), from configs.json, the registry or the Hub."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.core.errors import UserError
from pipeline.core.paths import CONFIGS
from pipeline.inputs.aliases import FIELDS
from pipeline.inputs.modeling import context_length, count_parameters, first_int, text_config


@dataclass(frozen=True)
class ModelRecord:
    """One model as the measurement sees it: its config.json facts, where they came from, and facts
    read from the config (`parameters` counted on the meta device, None if it cannot be built
    there; `plan_parameters` the same, else a rough 12*layers*width^2 + 2*vocab*width)."""

    model_id: str
    config: dict
    family: str | None
    model_type: str | None
    config_source: str | None
    config_revision: str | None
    parameters: int | None
    plan_parameters: int
    layers: int
    hidden: int
    vocab: int
    context: int | None
    use_cache: bool  # as the config sets it (the blog's loop uses it)

    def transformers_config(self):
        from pipeline.inputs.configs import config_from_dict

        return config_from_dict(self.config, self.model_id)

    @classmethod
    def from_config(cls, model_id: str, config, facts: dict, family: str | None, model_type: str | None,
                    source: str | None, revision: str | None) -> ModelRecord:
        """The record of a transformers `config` built from the config.json `facts` (or of the facts
        alone, where they cannot be built: `parameters` is then None)."""
        text = text_config(config)
        layers = _positive(first_int(text, FIELDS["layers"]))
        hidden = _positive(first_int(text, FIELDS["hidden"]))
        vocab = _positive(first_int(text, FIELDS["vocab"]))
        parameters = meta_parameters(config)
        return cls(model_id, facts, family, model_type, source, revision, parameters,
                   parameters or 12 * layers * hidden**2 + 2 * vocab * hidden, layers, hidden, vocab,
                   context_length(config), bool(getattr(text, "use_cache", True)))


def _positive(value: int | None) -> int:
    return value if value is not None and value > 0 else 1


def meta_parameters(config) -> int | None:
    from pipeline.inputs.modeling import build_model, training_config

    if isinstance(config, dict):
        return None  # facts that transformers refuses to build
    try:
        return count_parameters(build_model(training_config(config), device="meta"))
    except Exception:  # noqa: BLE001 - a model that cannot be built fails in its child, with a row
        return None


def load_model_records(configs_path, model_ids) -> tuple[dict[str, ModelRecord], list[str]]:
    """Records of `model_ids` from configs.json (ok entries) and the ids that have none."""
    from pipeline.inputs.configs import config_from_dict, read_config_records

    entries = read_config_records(configs_path)
    records, missing = {}, []
    for model_id in model_ids:
        entry = entries.get(model_id)
        if not entry or entry.get("status") != "ok":
            missing.append(model_id)
            continue
        try:
            config = config_from_dict(entry["config"], model_id)
        except UserError:  # planned from its facts; its points become rows saying why it cannot be built
            config = entry["config"]
        records[model_id] = ModelRecord.from_config(model_id, config, entry["config"], entry.get("family"),
                                                    entry.get("model_type"), entry.get("config_source"),
                                                    entry.get("config_revision"))
    return records, missing


def model_record(model_id: str | None, config_path: str | None, configs_path=CONFIGS) -> ModelRecord:
    """The record of one model for `measure`: configs.json first, else the registry or the Hub."""
    from pipeline.inputs.configs import config_from_file, resolve_model

    if model_id and Path(configs_path).exists():
        records, missing = load_model_records(configs_path, [model_id])
        if not missing:
            return records[model_id]
    try:
        resolved = config_from_file(config_path) if config_path else resolve_model(model_id)
    except ModuleNotFoundError as exc:  # the GPU machine has no jsonschema to read the registry with
        raise UserError(f"{model_id}: not in {configs_path}, and the registry cannot be read here "
                        f"({exc.name} is not installed)") from None
    return ModelRecord.from_config(resolved.model_id, resolved.config, resolved.config.to_dict(), None,
                                   resolved.config.model_type, resolved.source, resolved.revision)
