"""Stage 2: a transformers config for each model, from the Hub or from the registry's embedded facts.

Modes: `hub` downloads only `config.json` through huggingface_hub (cached, pinned revision when
given); `embedded` uses the facts in models.yaml; `auto` tries the Hub unless HF_HUB_OFFLINE is set
or the Hub is unreachable, and falls back to the embedded facts. Every config records its source.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from pipeline.core.paths import CONFIGS, DEFAULT_REGISTRY
from pipeline.core.errors import UserError
from pipeline.core.io import read_json_object
from pipeline.core.text import first_line, short
from pipeline.inputs.checks import check_config_facts, plain_facts
from pipeline.inputs.modeling import transformers_quiet
from pipeline.inputs.registry import ModelEntry

CONFIG_SOURCES = ("auto", "hub", "embedded")


@dataclass
class ResolvedConfig:
    model_id: str
    config: object  # transformers.PretrainedConfig
    source: str  # "hub", "embedded" or "file"
    revision: str | None = None
    facts: dict | None = None  # the config.json facts it was built from


def config_from_dict(facts: dict, label: str = "config") -> object:
    """A transformers config from config.json-style facts, checked first (`inputs.checks`), then by
    transformers' own validation; any problem is a one-line UserError naming the config."""
    from transformers import CONFIG_MAPPING

    label = short(label, 200, quote=False)
    facts = plain_facts(facts)
    check_config_facts(facts, label)
    model_type = facts["model_type"]
    if model_type not in CONFIG_MAPPING:
        raise UserError(f"{label}: field 'model_type': unknown model_type {short(model_type)}")
    try:
        with transformers_quiet():
            return CONFIG_MAPPING[model_type].from_dict(dict(facts))
    except Exception as exc:  # noqa: BLE001 - transformers' validation errors have no common base class
        raise UserError(f"{label}: {first_line(exc)}") from None



def as_config(config):
    """A transformers config from a config.json dict or the path of a config.json (or the transformers
    config itself): what the simulator's entry points take."""
    if isinstance(config, (str, Path)):
        config = read_config_file(config)
    if isinstance(config, dict):
        return config_from_dict(config)
    if not hasattr(config, "to_dict") or not getattr(config, "model_type", None):
        raise UserError(f"config must be a transformers config, a config.json dict or its path, not "
                        f"{type(config).__name__}")
    return config


def read_config_file(path) -> dict:
    """The facts of a Hugging Face `config.json` given by path (the one reader of such a file)."""
    return read_json_object(path, "config file not found", "not a JSON config file", "not a JSON object")


def config_from_file(path: str | Path) -> ResolvedConfig:
    """A Hugging Face `config.json` given by path (any model, not only registry ones)."""
    facts = read_config_file(path)
    name = facts.get("_name_or_path") or Path(path).stem
    return ResolvedConfig(model_id=str(name), config=config_from_dict(facts, str(path)), source="file", facts=facts)


def hub_is_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def download_config(model_id: str, revision: str | None = None) -> tuple[dict, str | None]:
    """config.json of a Hub repo (cache first; HF_TOKEN from the environment is used, never logged).

    Returns the facts and the commit they were read at.
    """
    from huggingface_hub import hf_hub_download

    path = Path(hf_hub_download(model_id, "config.json", revision=revision))
    commit = path.parent.name if path.parent.parent.name == "snapshots" else revision
    return json.loads(path.read_text()), commit


def resolve_config(entry: ModelEntry, mode: str = "auto", allow_remote_code: bool = False) -> ResolvedConfig:
    """The config of a registry entry, by `mode` (see module docstring)."""
    if mode not in CONFIG_SOURCES:
        raise UserError(f"config source {mode!r} is not one of {', '.join(CONFIG_SOURCES)}")
    if entry.problem:
        raise UserError(f"{short(entry.id, quote=False)}: {entry.problem}")
    if entry.trust_remote_code and not allow_remote_code:
        raise UserError(f"{entry.id}: needs trust_remote_code, which stays off unless you ask for it")
    if mode == "hub" or (mode == "auto" and not hub_is_offline()):
        try:
            facts, commit = download_config(entry.id, entry.revision)
            return ResolvedConfig(entry.id, config_from_dict(facts, entry.id), "hub", commit, facts)
        except UserError:
            raise
        except Exception as exc:  # noqa: BLE001 - any Hub failure means: use the embedded facts
            if mode == "hub":
                raise UserError(f"{entry.id}: config.json could not be downloaded ({type(exc).__name__})") from None
    return ResolvedConfig(entry.id, config_from_dict(entry.config, entry.id), "embedded", entry.revision,
                          dict(entry.config))


def resolve_model(model_id: str | None = None, config_path: str | None = None, mode: str = "auto",
                  registry_path=None, allow_remote_code: bool = False) -> ResolvedConfig:
    """The config for `--model ID` (registry entry, else the Hub) or `--config PATH`."""
    if bool(model_id) == bool(config_path):
        raise UserError("give exactly one of --model and --config")
    if config_path:
        return config_from_file(config_path)
    facts, source, revision = model_facts(model_id, mode, registry_path, allow_remote_code)
    return ResolvedConfig(model_id, config_from_dict(facts, model_id), source, revision, facts)


def model_facts(model_id: str, mode: str = "auto", registry_path=None,
                allow_remote_code: bool = False) -> tuple[dict, str, str | None]:
    """(config.json facts, source, revision) of a model id, without transformers: a registry entry's
    (the Hub's config.json when `mode` allows and the Hub answers, else its embedded facts), or a
    model outside the registry from the Hub. The registry is the package's own (its checkout's
    models.yaml) unless `registry_path` names another; nothing is read from the working directory."""
    from pipeline.inputs.registry import load_registry, safe_name

    safe_name(model_id)  # owner/name, nothing path-like
    if mode == "auto" and not hub_is_offline() and not hub_reachable():
        mode = "embedded"  # one quick probe rather than a download's retries (~30 s) on an offline machine
    entries = {e.id: e for e in load_registry(registry_path or DEFAULT_REGISTRY, check_model_types=False)}
    if model_id in entries:
        entry = entries[model_id]
        if entry.problem:
            raise UserError(f"{short(entry.id, quote=False)}: {entry.problem}")
        if entry.trust_remote_code and not allow_remote_code:
            raise UserError(f"{entry.id}: needs trust_remote_code, which stays off unless you ask for it")
        if mode == "hub" or (mode == "auto" and not hub_is_offline()):
            try:
                facts, commit = download_config(entry.id, entry.revision)
                return facts, "hub", commit
            except Exception as exc:  # noqa: BLE001 - any Hub failure means: use the embedded facts
                if mode == "hub":
                    raise UserError(f"{entry.id}: config.json could not be downloaded ({type(exc).__name__})") from None
        return dict(entry.config), "embedded", entry.revision
    if mode == "embedded" or hub_is_offline():
        raise UserError(f"model {short(model_id)} is not in the registry and the Hub is offline; use --config PATH")
    try:
        facts, commit = download_config(model_id)
    except Exception as exc:  # noqa: BLE001
        raise UserError(f"{short(model_id)}: config.json could not be downloaded ({type(exc).__name__})") from None
    return facts, "hub", commit


def write_configs(registry_path, out_path, mode: str = "auto", allow_remote_code: bool = False) -> dict:
    """The configs stage: every registry model's resolved config.json, with its source, in one file.

    A model whose config cannot be had is recorded with its reason; the others go on.
    """
    from pipeline.core.io import write_json
    from pipeline.inputs.registry import load_registry

    entries = load_registry(registry_path)
    if mode != "embedded" and not hub_is_offline() and not hub_reachable():
        if mode == "hub":
            raise UserError("--source hub: the Hugging Face Hub does not answer (one probe); use --source auto or "
                            "embedded for the registry's own facts")
        mode = "embedded"
        print("configs: the Hub does not answer; the registry's embedded facts are used", file=sys.stderr)
    resolved = {}
    for entry in entries:
        record = {"family": entry.family, "model_type": entry.model_type, "facts_source": entry.source}
        try:
            rc = resolve_config(entry, mode, allow_remote_code)
            record.update(status="ok", reason=None, config_source=rc.source, config_revision=rc.revision,
                          config=rc.facts)
        except UserError as exc:
            record.update(status="skipped", reason=str(exc), config_source=None, config_revision=None, config=None)
        except Exception as exc:  # noqa: BLE001 - whatever one model's config does, the others go on
            record.update(status="skipped", reason=first_line(exc), config_source=None, config_revision=None,
                          config=None)
        resolved[entry.id] = record
    write_json(resolved, out_path)
    return resolved


def hub_reachable(timeout: float = 3.0) -> bool:
    """One quick probe, so that an offline machine does not wait on a timeout per model."""
    import urllib.request

    from huggingface_hub import constants

    try:
        urllib.request.urlopen(constants.ENDPOINT, timeout=timeout)  # noqa: S310 - fixed https endpoint
        return True
    except Exception:  # noqa: BLE001
        return False


def read_config_records(path) -> dict[str, dict]:
    """configs.json, the configs stage's output: one record per model id (the one reader of it).

    A record has family, model_type, facts_source, status (ok | skipped), reason, config_source,
    config_revision and config (the config.json facts, None when skipped).
    """
    return read_json_object(path, "not found (run `python -m pipeline configs` first)", "not a readable configs.json",
                        "not a configs.json (a JSON object by model id)")


def resolved_from_record(model_id: str, record: dict) -> ResolvedConfig:
    """The ResolvedConfig of one ok configs.json record (its transformers config built now)."""
    return ResolvedConfig(model_id, config_from_dict(record["config"], model_id), record["config_source"],
                          record["config_revision"], record["config"])


def load_configs(path) -> dict[str, ResolvedConfig]:
    """The configs stage's output, as ResolvedConfig per model id (ok rows only)."""
    return {model_id: resolved_from_record(model_id, r)
            for model_id, r in read_config_records(path).items() if r["status"] == "ok"}


def add_cli(subparsers) -> None:
    parser = subparsers.add_parser("configs", help="resolve every registry model's config (Hub or embedded)")
    parser.add_argument("--registry", default=DEFAULT_REGISTRY)
    parser.add_argument("--out", default=CONFIGS)
    parser.add_argument("--source", choices=CONFIG_SOURCES, default="auto")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="allow remote code for entries that ask for it (off by default)")
    parser.set_defaults(handler=_configs_command)


def _configs_command(args) -> int:
    resolved = write_configs(args.registry, args.out, args.source, args.trust_remote_code)
    sources = {}
    for record in resolved.values():
        key = record["config_source"] or record["status"]
        sources[key] = sources.get(key, 0) + 1
    print(f"configs: {len(resolved)} models -> {args.out} ({', '.join(f'{k}: {v}' for k, v in sorted(sources.items()))})")
    return 0
