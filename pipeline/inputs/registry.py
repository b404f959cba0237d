"""Stage 1: the model registry (`models.yaml`), validated against `models.schema.json`.

Every problem is reported as one line naming the entry and the field (UserError).
"""

from __future__ import annotations

import copy
import functools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from pipeline.core.errors import UserError
from pipeline.core.io import read_input_text
from pipeline.core.paths import DEFAULT_REGISTRY
from pipeline.core.text import short
from pipeline.inputs.modeling import transformers_quiet

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
    problem: str | None = None  # why the entry cannot be used (its stages' rows say so); None: it can

    @property
    def model_type(self) -> str | None:
        return self.config.get("model_type")

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
    """Read and validate a registry file; raise UserError with one line on the first problem.

    The file is read at every call; what its text parses and validates to is kept for the next call
    with the same text (a question of the server's names a model: the registry is not parsed again),
    and each call gets its own copy."""
    path = Path(path)
    text = read_input_text(path, "registry file not found", "not a readable registry")
    data, refused = copy.deepcopy(checked_registry(text, str(path), check_model_types))
    return [_entry(item) for item in data["models"]] + refused


@functools.lru_cache(maxsize=2)
def checked_registry(text: str, label: str, check_model_types: bool) -> tuple[dict, list[ModelEntry]]:
    """(the registry's data, the entries refused for their size) of a registry file's text, validated."""
    data = read_yaml(text, label)
    refused = refuse_expanding_entries(data)
    if expanded_values(data, MAX_EXPANDED_VALUES) > MAX_EXPANDED_VALUES:
        raise UserError(f"{short(label, 200, quote=False)}: its aliases expand to more than {MAX_EXPANDED_VALUES:,} values")
    validate_registry_data(data, label, check_model_types=check_model_types)
    return data, refused


def refuse_expanding_entries(data) -> list[ModelEntry]:
    """The entries of `data["models"]` whose YAML aliases expand beyond MAX_ENTRY_VALUES, taken out
    of `data` and kept as entries whose `problem` says so (their stages' rows give the reason)."""
    if not isinstance(data, dict) or not isinstance(data.get("models"), list):
        return []
    kept, refused = [], []
    for index, item in enumerate(data["models"]):
        if expanded_values(item, MAX_ENTRY_VALUES) <= MAX_ENTRY_VALUES:
            kept.append(item)
            continue
        model_id = item.get("id") if isinstance(item, dict) and isinstance(item.get("id"), str) else f"entry {index}"
        family = item.get("family") if isinstance(item, dict) and isinstance(item.get("family"), str) else "?"
        refused.append(ModelEntry(model_id, family, "", {}, problem=f"entry {index}: its YAML aliases expand to "
                                  f"more than {MAX_ENTRY_VALUES:,} values"))
    data["models"] = kept
    return refused


# Values a registry, and one of its entries, may expand to, each use of a YAML alias counted again:
# 100 times the project's own, far below what nested aliases ("billion laughs") expand to.
MAX_EXPANDED_VALUES = 2_000_000
MAX_ENTRY_VALUES = 100_000


# libyaml's safe loader where PyYAML has it: the same documents, 0.06 s for models.yaml where the pure-Python one
# takes 0.4 s of every command that names a model (its nesting limit is an error, like Python's recursion limit).
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def read_yaml(text: str, label: str):
    """A YAML document (safe loader) whose aliases expand to at most MAX_EXPANDED_VALUES values; a
    one-line UserError naming the line of what is wrong."""
    try:
        data = yaml.load(text, Loader=SAFE_LOADER)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "not valid YAML"
        raise UserError(f"{short(label, 200, quote=False)}:{where}: {short(problem, quote=False)}") from None
    except (RecursionError, MemoryError):
        raise UserError(f"{short(label, 200, quote=False)}: nested too deeply to read") from None
    return data


def expanded_values(data, limit: int) -> int:
    """How many values `data` holds with every shared (aliased) part counted at each use; stops
    counting past `limit`."""
    count, stack = 0, [data]
    while stack and count <= limit:
        value = stack.pop()
        count += 1
        if isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return count


def validate_registry_data(data, name: str = "models.yaml", check_model_types: bool = True) -> None:
    import jsonschema  # here, not at the top: the GPU machine imports this module but has no jsonschema

    validator = jsonschema.Draft202012Validator(load_schema())
    errors = sorted(validator.iter_errors(data), key=lambda e: list(e.absolute_path))
    if errors:
        raise UserError(f"{name}: {_describe(errors[0], data)}")
    seen: dict[str, int] = {}
    for index, item in enumerate(data["models"]):
        if item["id"] in seen:
            raise UserError(f"{name}: entry {index} ({short(item['id'], quote=False)}): field 'id': duplicate of entry "
                            f"{seen[item['id']]}")
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
        where = f"entry {path[1]} ({short(label, quote=False)}): "
        path = path[2:]
    if error.validator == "required":
        missing = re.search(r"'([^']+)' is a required property", error.message)
        field_path = ".".join(str(p) for p in path + [missing.group(1) if missing else "?"])
        return f"{where}field '{field_path}': missing"
    if error.validator == "additionalProperties":
        return f"{where}{short(error.message, 200, quote=False)}"
    field_path = ".".join(str(p) for p in path) or "(top level)"
    return f"{where}field '{short(field_path, quote=False)}': {short(error.message, 160, quote=False)}"


def _check_config_facts(name: str, index: int, item: dict) -> None:
    check_shape_facts(item["config"], f"{name}: entry {index} ({short(item['id'], quote=False)})", field_prefix="config.")


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
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise UserError(f"{label}: field '{field_prefix}model_type': unknown model_type {short(model_type)}")
    config_class = CONFIG_MAPPING[model_type]
    aliases = config_class.attribute_map
    with transformers_quiet():
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
