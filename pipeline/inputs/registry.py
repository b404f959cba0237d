"""Stage 1: the model registry (`models.yaml`), validated against `models.schema.json`.

Every problem is reported as one line naming the entry and the field (UserError).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from pipeline.core.errors import UserError
from pipeline.core.paths import DEFAULT_REGISTRY

SCHEMA_PATH = Path(__file__).with_name("models.schema.json")

# Facts a config.json must state explicitly (under its own name or a transformers alias):
# without them the model would silently take a library default.
REQUIRED_SHAPE_FACTS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


@dataclass(frozen=True)
class ModelEntry:
    id: str
    family: str
    source: str
    config: dict = field(hash=False)
    revision: str | None = None
    trust_remote_code: bool = False
    notes: str | None = None

    @property
    def model_type(self) -> str:
        return self.config["model_type"]

    @property
    def safe_name(self) -> str:
        return safe_name(self.id)


def safe_name(model_id: str) -> str:
    """File-name form of a model id: `owner/name` -> `owner--name`; refuses anything path-like."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*", model_id) or ".." in model_id:
        raise UserError(f"model id {model_id!r} is not of the form owner/name")
    return model_id.replace("/", "--")


def model_id_from_safe_name(name: str) -> str:
    return name.replace("--", "/", 1)


def load_schema() -> dict:
    return json.loads(SCHEMA_PATH.read_text())


def load_registry(path: str | Path = DEFAULT_REGISTRY, check_model_types: bool = True) -> list[ModelEntry]:
    """Read and validate a registry file; raise UserError with one line on the first problem."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: registry file not found") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise UserError(f"{path}:{where} is not valid YAML") from None
    validate_registry_data(data, str(path), check_model_types=check_model_types)
    return [_entry(item) for item in data["models"]]


def validate_registry_data(data, name: str = "models.yaml", check_model_types: bool = True) -> None:
    import jsonschema  # here, not at the top: the GPU machine imports this module but has no jsonschema

    validator = jsonschema.Draft202012Validator(load_schema())
    errors = sorted(validator.iter_errors(data), key=lambda e: list(e.absolute_path))
    if errors:
        raise UserError(f"{name}: {_describe(errors[0], data)}")
    seen: dict[str, int] = {}
    for index, item in enumerate(data["models"]):
        if item["id"] in seen:
            raise UserError(
                f"{name}: entry {index} ({item['id']}): field 'id': duplicate of entry {seen[item['id']]}"
            )
        seen[item["id"]] = index
    if check_model_types:
        for index, item in enumerate(data["models"]):
            _check_config_facts(name, index, item)


def _describe(error, data) -> str:
    path = list(error.absolute_path)
    where = ""
    if len(path) >= 2 and path[0] == "models" and isinstance(path[1], int):
        item = data["models"][path[1]]
        label = item.get("id", "?") if isinstance(item, dict) else "?"
        where = f"entry {path[1]} ({label}): "
        path = path[2:]
    if error.validator == "required":
        missing = re.search(r"'([^']+)' is a required property", error.message)
        field_path = ".".join(str(p) for p in path + [missing.group(1) if missing else "?"])
        return f"{where}field '{field_path}': missing"
    if error.validator == "additionalProperties":
        return f"{where}{error.message}"
    field_path = ".".join(str(p) for p in path) or "(top level)"
    return f"{where}field '{field_path}': {error.message}"


def _check_config_facts(name: str, index: int, item: dict) -> None:
    check_shape_facts(item["config"], f"{name}: entry {index} ({item['id']})", field_prefix="config.")


def check_shape_facts(facts: dict, label: str, field_prefix: str = "") -> None:
    """The one config-shape check (registry entries, `--config` files): a known model_type, and
    each shape fact its config class has stated (else transformers silently takes its defaults).

    A fact the class does not have is not asked for (no attention heads in a state-space model);
    a fact may be stated under the class's alias (gpt2's n_embd) or in a nested text_config.
    """
    from transformers import CONFIG_MAPPING

    model_type = facts.get("model_type")
    if not model_type:
        raise UserError(f"{label}: field '{field_prefix}model_type': missing")
    if model_type not in CONFIG_MAPPING:
        raise UserError(f"{label}: field '{field_prefix}model_type': unknown model_type {model_type!r}")
    config_class = CONFIG_MAPPING[model_type]
    aliases = config_class.attribute_map
    defaults = config_class()
    for fact in REQUIRED_SHAPE_FACTS:
        if not hasattr(defaults, fact):
            continue
        names = {fact, aliases.get(fact, fact)}
        if not names & facts.keys() and not _nested_text_config_has(facts, names):
            raise UserError(f"{label}: field '{field_prefix}{fact}': missing")


def _nested_text_config_has(config: dict, names: set[str]) -> bool:
    text = config.get("text_config")
    return isinstance(text, dict) and bool(names & text.keys())


def _entry(item: dict) -> ModelEntry:
    return ModelEntry(
        id=item["id"],
        family=item["family"],
        source=item["source"],
        config=dict(item["config"]),
        revision=item.get("revision"),
        trust_remote_code=bool(item.get("trust_remote_code", False)),
        notes=item.get("notes"),
    )


def select(entries: list[ModelEntry], ids: list[str] | None) -> list[ModelEntry]:
    """The entries named in `ids` (all when None); an unknown id is a UserError."""
    if not ids:
        return entries
    by_id = {entry.id: entry for entry in entries}
    unknown = [model_id for model_id in ids if model_id not in by_id]
    if unknown:
        raise UserError(f"model {unknown[0]!r} is not in the registry")
    return [by_id[model_id] for model_id in ids]
