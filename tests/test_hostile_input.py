"""Hostile input (issue 18): every bad input gets one clear line and exit code 2, no traceback; a stage
survives one bad model (the good ones written, the bad one a row with its reason); nothing outside a
command's own output is touched; every case ends within a time and memory bound.

Black-box only, so that it survives a restructure of the package: the command line
(`python -m pipeline ...`, with its working directory and environment set per case) and the public
Python API (`pipeline.estimate.estimate / max_batch_size / max_seq_len`, `pipeline.activations.count`).
No internal module is imported.

Every case runs in a child process of its own session, killed with its process group after
`timeout` seconds, and may map 3 GiB of address space beyond its baseline (RLIMIT_AS = the address space
it starts with + 3 GiB, whatever torch's build maps; `tests/data/hostile/runner.py`,
`tests/test_hostile_bounds.py`). The children are forked
from one process that imported torch, transformers and peft once (a fresh interpreter per case costs
~5 s of imports each; HOSTILE_FRESH=1 runs every case as a real `python -m pipeline` / `python -c`
instead). All selected cases run once, concurrently (HOSTILE_JOBS, default twice the CPU count, 4 to
8; at most one `heavy` case, one that may take gigabytes before it fails, at a time), in a module
fixture; each test then checks one case's outcome. HOSTILE_REPORT=PATH writes every
case's outcome and its problems as JSON (the catalogue of what is still broken).

Each case has its own workspace (its working directory and its inputs), snapshotted before and after:
a file outside the case's declared outputs that is changed, added or removed is a failure. The
repository's results/ and models.yaml are checked the same way.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import re
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import yaml

pytestmark = pytest.mark.slow  # one module fixture runs every case: about 1.5 minutes on 2 cores

REPO = Path(__file__).resolve().parent.parent
RUNNER = REPO / "tests" / "data" / "hostile" / "runner.py"
GIB = 2**30
MEM = 3 * GIB  # address space a case may map beyond its baseline (its RLIMIT_AS is the baseline + MEM)
# Time bounds catch hangs, so they are wide (several times what a case takes on an idle 2-core machine) and scaled
# by the machine's slowdown now (`calibrated_slowdown`: a busy or slow machine gets longer bounds, never shorter).
T_REJECT = 20  # seconds: bad input is rejected before any work (a child starts in ~0.1 s)
T_WORK = 60  # seconds: a stage on two tiny models plus one bad one (alone about 10-18 s on 2 idle cores)
REFERENCE_WORK_SECONDS = 0.14  # CALIBRATION's best time on an idle 2-core machine of CI's kind (2026-11-28)
CALIBRATION = "import time; t = time.perf_counter(); sum(i * i for i in range(3_000_000)); print(time.perf_counter() - t)"
MAX_RSS_GUARDED = 1.5 * GIB  # a refusal to build what cannot fit is decided before it is built
FRESH = os.environ.get("HOSTILE_FRESH") == "1"
FRESH_EXTRA = 40  # seconds of imports a fresh interpreter adds
MAX_LINE = 300
QWEN15 = "Qwen/Qwen2.5-1.5B"
QWEN15_PARAMETERS = 1_543_714_304  # README: N of Qwen2.5-1.5B
GOOD_MODELS = ("EleutherAI/pythia-14m", "distilbert/distilgpt2")

# A small valid llama config: every method answers it in about a second.
GOOD = {"model_type": "llama", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512}


# --- cases ---------------------------------------------------------------------------------------

@dataclass
class Case:
    """One hostile input.

    expect: "reject" (exit 2, one line naming the problem: one of `words`), "clean" (exit 0, or exit 2
    with one line; no traceback: for values that are valid but extreme), "ok" (exit 0), "stage"
    (exit 0 or 1, `check` looks at the tables), "stage_or_reject" (a stage, or a one-line exit 2),
    "api_reject" (raises an exception of the package or ValueError/TypeError, one line naming one of
    `words`), "api_equal" (returns {"got": x, "want": y} with x == y).
    argv and code may hold {ws} (the case's workspace) and {repo}.
    """

    id: str
    expect: str
    argv: list = None
    code: str = None
    words: tuple = ()
    setup: Callable = None  # setup(ws: Path)
    outputs: tuple = ()  # paths under ws that the command may write or change
    cwd: str = "{ws}"
    timeout: float = T_REJECT
    env: dict = field(default_factory=dict)
    fresh: bool = False
    heavy: bool = False  # may take gigabytes before it fails: run one such case at a time
    check: Callable = None  # check(outcome, ws) -> list of problems
    issue: str = ""  # the item of issue 18 it belongs to ("own" when not listed there)

    @property
    def kind(self) -> str:
        return "api" if self.code is not None else "cli"


def write(path: Path, data) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, bytes):
        path.write_bytes(data)
    elif isinstance(data, str):
        path.write_text(data)
    else:
        path.write_text(json.dumps(data))
    return path


def good_config(ws: Path) -> None:
    write(ws / "good.json", GOOD)


def with_files(*writers) -> Callable:
    def setup(ws: Path) -> None:
        for writer in writers:
            writer(ws)
    return setup


def json_file(name: str, data) -> Callable:
    return lambda ws: write(ws / name, data)


def deep_json(name: str, prefix: str = '{"model_type": "llama", "x": ', depth: int = 200_000) -> Callable:
    return lambda ws: write(ws / name, prefix + "[" * depth + "]" * depth + "}")


def huge_json(name: str, megabytes: int = 50) -> Callable:
    """A valid config with a 50 MB string in it."""
    def setup(ws: Path) -> None:
        text = json.dumps(GOOD)[:-1] + ', "padding": "' + "x" * (megabytes * 2**20) + '"}'
        write(ws / name, text)
    return setup


def fifo(name: str) -> Callable:
    return lambda ws: os.mkfifo(ws / name)


def directory(name: str) -> Callable:
    return lambda ws: (ws / name).mkdir(parents=True)


def mutated(**changes) -> dict:
    config = dict(GOOD)
    for key, value in changes.items():
        if value is DELETE:
            config.pop(key, None)
        else:
            config[key] = value
    return config


DELETE = object()

# Everyday bad configs (issue 18 items 3 and 5; the NaN one is written with JSON's NaN literal).
BAD_CONFIGS = {
    "hidden_not_multiple_of_heads": (mutated(hidden_size=65), (r"hidden", r"head"), "3"),
    "hidden_1000_heads_7": (mutated(hidden_size=1000, intermediate_size=2048, num_attention_heads=7,
                                    num_key_value_heads=7), (r"hidden", r"head"), "5"),
    "hidden_string": (mutated(hidden_size="64"), (r"hidden_size",), "3"),
    "hidden_float": (mutated(hidden_size=64.5), (r"hidden_size",), "3"),
    "hidden_nan": (mutated(hidden_size=math.nan), (r"hidden_size",), "3"),
    "hidden_bool": (mutated(hidden_size=True), (r"hidden_size",), "3"),
    "hidden_negative": (mutated(hidden_size=-64), (r"hidden_size",), "own"),
    "hidden_huge": (mutated(hidden_size=10**30), (r"hidden_size", r"limit", r"large"), "own"),
    "heads_zero": (mutated(num_attention_heads=0), (r"num_attention_heads", r"heads"), "3"),
    "kv_heads_3_of_16": (mutated(num_attention_heads=16, num_key_value_heads=3),
                         (r"key_value", r"kv", r"heads"), "5"),
    "intermediate_negative": (mutated(intermediate_size=-5), (r"intermediate_size",), "5"),
    "vocab_zero": (mutated(vocab_size=0), (r"vocab_size",), "5"),
    "layers_negative": (mutated(num_hidden_layers=-1), (r"num_hidden_layers", r"layers"), "own"),
    "layers_100000": (mutated(num_hidden_layers=100_000), (r"num_hidden_layers", r"layers"), "4"),
    "model_type_list": (mutated(model_type=["llama"]), (r"model_type",), "3"),
    "model_type_1mb": (mutated(model_type="x" * 2**20), (r"model_type",), "8"),
    "model_type_control_chars": (mutated(model_type="llama\n\x1b[31mred\r\x00"), (r"model_type",), "own"),
    "model_type_unicode": (mutated(model_type="llаma\u202e"), (r"model_type",), "own"),  # Cyrillic a, RTL mark
    "model_type_missing": (mutated(model_type=DELETE), (r"model_type",), "own"),
}

# Hostile files given as a config path (any reader of a JSON file).
BAD_FILES = {
    "dev_zero": (None, "/dev/zero", (r"/dev/zero",)),
    "dev_urandom": (None, "/dev/urandom", (r"/dev/urandom",)),
    "fifo": (fifo("fifo.json"), "{ws}/fifo.json", (r"fifo\.json",)),
    "directory": (directory("dir.json"), "{ws}/dir.json", (r"dir\.json",)),
    "missing": (None, "{ws}/missing.json", (r"missing\.json",)),
    "empty": (json_file("empty.json", ""), "{ws}/empty.json", (r"empty\.json",)),
    "not_utf8": (json_file("latin.json", b'\xff\xfe{"model_type": "ll\xe1ma"}'), "{ws}/latin.json", (r"latin\.json",)),
    "json_list": (json_file("list.json", [GOOD]), "{ws}/list.json", (r"list\.json",)),
    "deep_200000": (deep_json("deep.json"), "{ws}/deep.json", (r"deep\.json",)),
}

ESTIMATE = ["estimate", "--batch", "1", "--seq", "16", "--precision", "bf16", "--json"]
PARAMS_ESTIMATE = ["estimate", "--params", "1000000000", "--batch", "1", "--seq", "128", "--precision", "bf16",
                   "--json"]


def config_entry_points(path: str) -> dict:
    return {
        "estimate_heuristic": [*ESTIMATE, "--config", path, "--method", "heuristic"],
        "estimate_formula": [*ESTIMATE, "--config", path, "--method", "formula"],
        "estimate_exact": [*ESTIMATE, "--config", path, "--method", "exact"],
        "count": ["count", "--config", path, "--json"],
    }


def bad_config_cases() -> list[Case]:
    cases = []
    for name, (config, words, issue) in BAD_CONFIGS.items():
        text = json.dumps(config)  # NaN stays JSON's NaN literal, as Python writes it
        for entry, argv in config_entry_points("{ws}/config.json").items():
            cases.append(Case(f"config-{name}-{entry}", "reject", argv, words=words, 
                              setup=json_file("config.json", text), issue=issue))
    for name, (setup, path, words) in BAD_FILES.items():
        points = config_entry_points(path)
        heavy = name.startswith("dev_")
        if name == "dev_urandom":  # the same readers as /dev/zero, and slow to fail (gigabytes of random): one
            cases.append(Case(f"file-{name}-config-estimate_heuristic", "reject", points["estimate_heuristic"],
                              words=words, heavy=True, issue="own"))
            continue
        for entry in ("estimate_heuristic",) if heavy else ("estimate_heuristic", "estimate_formula", "count"):
            cases.append(Case(f"file-{name}-config-{entry}", "reject", points[entry], words=words, setup=setup,
                              heavy=heavy, issue="3" if name == "deep_200000" else "4" if name == "dev_zero" else "own"))
        cases.append(Case(f"file-{name}-training-args", "reject",
                          [*PARAMS_ESTIMATE, "--training-args", path], words=words, setup=setup, heavy=heavy,
                          issue="3" if name == "deep_200000" else "own"))
        cases.append(Case(f"file-{name}-peft-config", "reject",
                          [*ESTIMATE, "--config", "{ws}/good.json", "--method", "formula", "--peft-config", path],
                          words=words, setup=with_files(good_config, setup) if setup else good_config, heavy=heavy,
                          issue="3" if name == "deep_200000" else "own"))
        cases.append(Case(f"file-{name}-coefficients", "reject",
                          [*PARAMS_ESTIMATE, "--coefficients", path], words=words, setup=setup, heavy=heavy,
                          issue="own"))
        cases.append(Case(f"file-{name}-registry", "reject",
                          ["configs", "--registry", path, "--out", "{ws}/out/configs.json", "--source", "embedded"],
                          words=words, setup=setup, outputs=("out",), heavy=heavy, issue="own"))
    for entry, argv in config_entry_points("{ws}/huge.json").items():
        cases.append(Case(f"file-huge_50mb-config-{entry}", "clean", argv, words=(r"huge\.json", r"large", r"MB"),
                          setup=huge_json("huge.json"), issue="own"))
    cases.append(Case("file-deep_200000-simulate-config", "reject",
                      ["simulate", "--config", "{ws}/deep.json", "--batch", "1", "--seq", "8", "--precision", "fp32"],
                      words=(r"deep\.json",), setup=deep_json("deep.json"), issue="own"))
    for entry, argv in config_entry_points("{ws}/good.json").items():
        cases.append(Case(f"control-good-config-{entry}", "ok", argv, setup=good_config, issue="control"))
    return cases


# Numeric options: every one given NaN, inf, a negative number, zero and a huge value.
HUGE_INT = "1" + "0" * 30
NUMERIC_OPTIONS = [
    # (command, option, float?, zero valid?, argv around it, setup)
    ("estimate", "--batch", False, False, ["estimate", "--params", "1e9", "--seq", "128", "--precision", "bf16", "--json"], None),
    ("estimate", "--seq", False, False, ["estimate", "--params", "1e9", "--batch", "1", "--precision", "bf16", "--json"], None),
    ("estimate", "--gradient-accumulation", False, False, [*PARAMS_ESTIMATE, "--client", "trainer"], None),
    ("estimate", "--num-gpus", False, False, [*PARAMS_ESTIMATE, "--sharding", "ddp"], None),
    ("estimate", "--lora-r", False, False, [*ESTIMATE, "--config", "{ws}/good.json", "--method", "formula"], good_config),
    ("estimate", "--lora-alpha", False, False,
     [*ESTIMATE, "--config", "{ws}/good.json", "--method", "formula", "--lora-r", "8"], good_config),
    ("estimate", "--gpu-memory", True, False, PARAMS_ESTIMATE, None),
    ("estimate", "--params", True, False, ["estimate", "--batch", "1", "--seq", "128", "--precision", "bf16", "--json"], None),
    ("estimate", "--active-params", True, False, PARAMS_ESTIMATE, None),
    ("count", "--batch", False, False, ["count", "--config", "{ws}/good.json", "--seq", "8", "--json"], good_config),
    ("count", "--seq", False, False, ["count", "--config", "{ws}/good.json", "--batch", "1", "--json"], good_config),
    ("simulate", "--batch", False, False,
     ["simulate", "--config", "{ws}/good.json", "--seq", "8", "--precision", "fp32", "--json"], good_config),
    ("simulate", "--seq", False, False,
     ["simulate", "--config", "{ws}/good.json", "--batch", "1", "--precision", "fp32", "--json"], good_config),
    ("measure", "--batch", False, False,
     ["measure", "--config", "{ws}/good.json", "--seq", "8", "--precision", "fp32", "--device", "cpu", "--json"], good_config),
    ("measure", "--seq", False, False,
     ["measure", "--config", "{ws}/good.json", "--batch", "1", "--precision", "fp32", "--device", "cpu", "--json"], good_config),
    ("measure", "--gradient-accumulation", False, False,
     ["measure", "--config", "{ws}/good.json", "--batch", "1", "--seq", "8", "--precision", "fp32", "--device", "cpu",
      "--client", "trainer", "--json"], good_config),
    ("sweep", "--gpu-memory-gib", True, False, ["sweep", "--plan", "{ws}/plan.yaml", "--dry-run"], None),
    ("sweep", "--time-limit", False, False, ["sweep", "--plan", "{ws}/plan.yaml", "--dry-run"], None),
    ("sweep", "--gpus", False, False, ["sweep", "--plan", "{ws}/plan.yaml", "--dry-run"], None),
    ("sweep", "--child-timeout", False, False, ["sweep", "--plan", "{ws}/plan.yaml", "--dry-run"], None),
    ("sweep", "--batch-sizes", False, False, ["sweep", "--plan", "{ws}/plan.yaml", "--dry-run"], None),
    ("sweep", "--seq-lens", False, False, ["sweep", "--plan", "{ws}/plan.yaml", "--dry-run"], None),
    ("sweep", "--max-step-flops", True, False, ["sweep", "--plan", "{ws}/plan.yaml", "--dry-run"], None),
    ("activations", "--workers", False, False,
     ["activations", "--registry", "{ws}/models.yaml", "--configs", "{ws}/configs.json", "--models-out",
      "{ws}/out/models.parquet", "--activations-out", "{ws}/out/activations.parquet"], None),
    ("simulate-peaks", "--workers", False, False,
     ["simulate-peaks", "--peaks", "{ws}/peaks.parquet", "--configs", "{ws}/configs.json", "--out",
      "{ws}/out/simulated.parquet"], None),
    ("fit", "--seed", False, True,
     ["fit", "--models", "{ws}/models.parquet", "--activations", "{ws}/activations.parquet", "--peaks",
      "{ws}/peaks.parquet", "--configs", "{ws}/configs.json", "--out", "{ws}/out/coefficients.json"], None),
    ("fit", "--resamples", False, False,
     ["fit", "--models", "{ws}/models.parquet", "--activations", "{ws}/activations.parquet", "--peaks",
      "{ws}/peaks.parquet", "--configs", "{ws}/configs.json", "--out", "{ws}/out/coefficients.json"], None),
    ("measure-distributed", "--devices", False, False,
     ["measure-distributed", "--plan", "{ws}/plan.yaml", "--out", "{ws}/out/peaks.parquet", "--dry-run"], None),
]


def option_words(option: str) -> tuple:
    return (option.lstrip("-").replace("-", "_"),)  # "_" matches "-", "_" and " " (one_line_problems)


def numeric_cases() -> list[Case]:
    cases = []
    for command, option, is_float, zero_ok, argv, setup in NUMERIC_OPTIONS:
        values = {"nan": "nan", "inf": "inf", "negative": "-1", "zero": "0",
                  "huge": "1e300" if is_float else HUGE_INT}
        if zero_ok:
            values.pop("zero")
        for label, value in values.items():
            expect = "clean" if label == "huge" else "reject"
            cases.append(Case(f"option-{command}-{option.lstrip('-')}-{label}", expect, [*argv, f"{option}={value}"],
                              words=option_words(option), setup=setup, outputs=("out",),
                              issue="3" if (command, option, label) == ("estimate", "--gpu-memory", "huge") else "own"))
    return cases


# --- adapter_config.json and TrainingArguments files ---------------------------------------------

ADAPTER = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
TRAINING = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 1, "bf16": True,
            "gradient_checkpointing": False, "optim": "adamw_torch_fused"}


def notes_name(word: str) -> Callable:
    """Exit 0 with a note naming `word`, or exit 2 with a line naming it: never silently ignored."""
    def check(outcome: dict, ws: Path) -> list:
        if outcome["rc"] == 2:
            return []
        try:
            answer = json.loads(outcome["stdout"])
        except ValueError:
            return [f"stdout is not the JSON answer: {outcome['stdout'][:200]!r}"]
        notes = " ".join(answer.get("notes", []))
        return [] if re.search(word, notes, re.I) else [f"{word} is ignored without a note (notes: {notes!r})"]
    return check


def settings_file_cases() -> list[Case]:
    cases = []
    adapter_argv = [*ESTIMATE, "--config", "{ws}/good.json", "--method", "formula", "--peft-config",
                    "{ws}/adapter_config.json"]
    adapters = {
        "r_string": ({"r": "8"}, (r"\br\b",), "own"),
        "r_bool": ({"r": True}, (r"\br\b",), "own"),
        "r_float": ({"r": 8.5}, (r"\br\b",), "own"),
        "r_million": ({"r": 1_000_000}, (r"\br\b", r"rank", r"limit"), "4"),
        "alpha_nan": ({"lora_alpha": math.nan}, (r"lora_alpha", r"alpha"), "own"),
        "targets_number": ({"target_modules": 5}, (r"target",), "own"),
        "use_dora_string": ({"use_dora": "false"}, (r"use_dora",), "6"),
        "use_rslora_string": ({"use_rslora": "no"}, (r"use_rslora",), "6"),
    }
    for name, (change, words, issue) in adapters.items():
        cases.append(Case(f"adapter_config-{name}", "reject", adapter_argv, words=words, issue=issue,
                          setup=with_files(good_config, json_file("adapter_config.json", json.dumps({**ADAPTER, **change})))))
    for name, change in (("use_dora", {"use_dora": True}), ("modules_to_save", {"modules_to_save": ["lm_head"]})):
        cases.append(Case(f"adapter_config-{name}-ignored", "clean", adapter_argv, words=(name,), issue="8",
                          check=notes_name(name),
                          setup=with_files(good_config, json_file("adapter_config.json", {**ADAPTER, **change}))))
    # The file gives the batch, the precision and the client.
    training_argv = ["estimate", "--params", "1000000000", "--seq", "128", "--json", "--training-args",
                     "{ws}/training_args.json"]
    trainings = {
        "bf16_string_false": ({"bf16": "false"}, (r"bf16",), "6"),
        "fp16_string_true": ({"bf16": False, "fp16": "true"}, (r"fp16",), "6"),
        "checkpointing_string_no": ({"gradient_checkpointing": "no"}, (r"gradient_checkpointing",), "6"),
        "checkpointing_int_1": ({"gradient_checkpointing": 1}, (r"gradient_checkpointing",), "6"),
        "batch_string": ({"per_device_train_batch_size": "8"}, (r"per_device_train_batch_size",), "control"),
        "batch_bool": ({"per_device_train_batch_size": True}, (r"per_device_train_batch_size",), "control"),
        "accumulation_nan": ({"gradient_accumulation_steps": math.nan}, (r"gradient_accumulation_steps",), "own"),
        "optim_unknown": ({"optim": "banana"}, (r"optim", r"banana"), "own"),
    }
    for name, (change, words, issue) in trainings.items():
        cases.append(Case(f"training_args-{name}", "reject", training_argv, words=words, issue=issue,
                          setup=json_file("training_args.json", json.dumps({**TRAINING, **change}))))
    # The meaning must not flip: "bf16": false (a real boolean) gives a different answer than "bf16": true.
    return cases


def memory_guard(outcome: dict, ws: Path) -> list:
    rss = outcome["maxrss_kib"] * 1024
    return [] if rss < MAX_RSS_GUARDED else [f"unguarded: grew to {rss / GIB:.1f} GiB before it failed"]


# --- other options of estimate / count ------------------------------------------------------------

def option_cases() -> list[Case]:
    config = ["--config", "{ws}/good.json"]
    return [
        Case("estimate-exact-seq_1e9", "clean", [*ESTIMATE[:3], "--seq", "1000000000", *ESTIMATE[5:], "--model",
                                                 "EleutherAI/pythia-14m", "--method", "exact"],
             words=(r"seq", r"limit"), issue="3"),
        Case("estimate-exact-batch_1e12", "clean", ["estimate", "--batch", "1000000000000", "--seq", "128", "--precision",
                                                    "bf16", "--json", "--model", "EleutherAI/pythia-14m", "--method",
                                                    "exact"], words=(r"batch", r"limit"), issue="3"),
        Case("estimate-heuristic-batch_1e12", "clean", ["estimate", "--batch", "1000000000000", "--seq", "16",
                                                        "--precision", "bf16", "--json", *config],
             words=(r"batch", r"limit"), setup=good_config, issue="3"),
        Case("estimate-exact-lora_r_1e6", "reject", [*ESTIMATE, *config, "--method", "exact", "--lora-r", "1000000"],
             words=(r"lora", r"\br\b", r"rank"), setup=good_config, heavy=True, issue="4"),
        Case("estimate-lora_targets_unknown", "reject", [*ESTIMATE, *config, "--method", "exact", "--lora-r", "8",
                                                         "--lora-targets", "no_such_module"],
             words=(r"no_such_module", r"target"), setup=good_config, issue="own"),
        Case("estimate-attn_implementation_unknown", "reject", [*ESTIMATE, *config, "--method", "exact",
                                                                "--attn-implementation", "banana"],
             words=(r"attn", r"banana"), setup=good_config, issue="own"),
        Case("estimate-gpu_name_control_chars", "reject", [*PARAMS_ESTIMATE, "--gpu", "H100\n\x1b[2Jx"],
             words=(r"gpu", r"H100"), issue="own"),
        Case("estimate-model_id_1mb", "reject", [*ESTIMATE, "--model", "o/" + "x" * 2**20],
             words=(r"model",), issue="8"),
        Case("estimate-model_id_newline", "reject", [*ESTIMATE, "--model", "Qwen/Qwen2.5-1.5B\nerror: fake second line"],
             words=(r"model", r"Qwen"), issue="own"),
        Case("estimate-model_id_path", "reject", [*ESTIMATE, "--model", "../../etc/passwd"],
             words=(r"model", r"passwd"), issue="own"),
        Case("estimate-model_id_unicode", "reject", [*ESTIMATE, "--model", "Qwen/Qwen2.5-1.5B\u202e\u0301"],
             words=(r"model", r"Qwen"), issue="own"),
        Case("count-model_id_1mb", "reject", ["count", "--model", "o/" + "x" * 2**20], words=(r"model",), issue="8"),
        Case("count-model_id_control_chars", "reject", ["count", "--model", "a/b\n\x1b[31mc\r"],  # (no NUL: argv cannot hold one)
             words=(r"model",), issue="own"),
        # A 7B fp32 model (28 GiB of weights) on the CPU: refused, or an error row, before it is built.
        Case("measure-cpu-7b-fp32", "clean", ["measure", "--model", "Qwen/Qwen2.5-7B", "--batch", "1", "--seq", "16",
                                              "--precision", "fp32", "--device", "cpu", "--configs", "{ws}/none.json"],
             words=(r"memory", r"GiB", r"RAM", r"large"), issue="4", timeout=T_WORK, heavy=True, check=memory_guard),
    ]


# --- registries: YAML aliases, bad entries, the stages ----------------------------------------------

@functools.lru_cache(maxsize=1)
def project_registry() -> dict:
    return {m["id"]: m for m in yaml.safe_load((REPO / "models.yaml").read_text())["models"]}


def registry_entries(ids=GOOD_MODELS) -> list[dict]:
    return [json.loads(json.dumps(project_registry()[i])) for i in ids]


def bad_entry(model_id: str, config: dict) -> dict:
    return {"id": model_id, "family": "hostile", "source": "tests/test_hostile_input.py", "config": config}


BILLION_LAUGHS = """
models:
- id: owner/laughs
  family: hostile
  source: test
  config:
    model_type: llama
    vocab_size: 1000
    hidden_size: 64
    intermediate_size: 128
    num_hidden_layers: 2
    num_attention_heads: 4
    max_position_embeddings: 512
    a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
    b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
    c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
    d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
    e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
    f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
    g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
    h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
    i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
"""


def laughs_registry(ws: Path) -> None:
    good = yaml.safe_dump({"models": registry_entries()}, sort_keys=False)
    write(ws / "models.yaml", good + BILLION_LAUGHS.split("models:\n", 1)[1])


def registry_with(bad: dict) -> Callable:
    return lambda ws: write(ws / "models.yaml", yaml.safe_dump({"models": [*registry_entries(), bad]},
                                                               sort_keys=False, width=10**9))


def configs_record(entry: dict) -> dict:
    """A configs.json record (docs/architecture.md: the configs stage's output) of a registry entry."""
    return {"family": entry["family"], "model_type": entry["config"]["model_type"], "facts_source": entry["source"],
            "status": "ok", "reason": None, "config_source": "embedded", "config_revision": None,
            "config": entry["config"]}


def stage_inputs(bad: dict) -> Callable:
    """models.yaml with the good models and `bad`, and the configs.json the configs stage would write."""
    def setup(ws: Path) -> None:
        entries = [*registry_entries(), bad]
        write(ws / "models.yaml", yaml.safe_dump({"models": entries}, sort_keys=False, width=10**9))
        write(ws / "configs.json", {e["id"]: configs_record(e) for e in entries})
    return setup


def configs_table_check(bad_id: str | None) -> Callable:
    def check(outcome: dict, ws: Path) -> list:
        if outcome["rc"] == 2 and bad_id is None:
            return []
        path = ws / "out" / "configs.json"
        if not path.is_file():
            return [f"no {path.name} written for the good models"]
        records = json.loads(path.read_text())
        problems = [f"{m}: not written ok" for m in GOOD_MODELS if records.get(m, {}).get("status") != "ok"]
        if bad_id:
            bad = records.get(bad_id)
            if not bad or bad.get("status") == "ok" or not bad.get("reason"):
                problems.append(f"{bad_id}: not a row with a non-ok status and a reason ({bad})")
        return problems
    return check


def activations_table_check(bad_id: str) -> Callable:
    def check(outcome: dict, ws: Path) -> list:
        import pandas as pd

        path = ws / "out" / "models.parquet"
        if not path.is_file() or not (ws / "out" / "activations.parquet").is_file():
            return ["models.parquet / activations.parquet not written for the good models"]
        models = pd.read_parquet(path).set_index("model_id")
        problems = [f"{m}: not ok in models.parquet" for m in GOOD_MODELS
                    if m not in models.index or models.loc[m, "status"] != "ok"]
        if bad_id not in models.index:
            problems.append(f"{bad_id}: no row in models.parquet")
        elif models.loc[bad_id, "status"] == "ok" or not models.loc[bad_id, "reason"]:
            problems.append(f"{bad_id}: status {models.loc[bad_id, 'status']!r}, reason {models.loc[bad_id, 'reason']!r}")
        activations = pd.read_parquet(ws / "out" / "activations.parquet")
        for model in GOOD_MODELS:
            rows = activations[activations["model_id"] == model]
            if rows.empty or (rows["status"] != "ok").all():
                problems.append(f"{model}: no ok rows in activations.parquet")
        bad_rows = activations[activations["model_id"] == bad_id]
        if (bad_rows["status"] == "ok").any():
            problems.append(f"{bad_id}: has ok rows in activations.parquet")
        summary = re.search(r"ok: (\d+)", outcome["stdout"])
        if summary and int(summary.group(1)) != int((models["status"] == "ok").sum()):
            problems.append(f"summary says ok: {summary.group(1)}, the table has {(models['status'] == 'ok').sum()}")
        return problems
    return check


STAGE_BAD = {
    "hidden_not_multiple_of_heads": (mutated(hidden_size=65), "2"),
    "kv_heads_3_of_16": (mutated(num_attention_heads=16, num_key_value_heads=3), "5"),
    "layers_100000": (mutated(num_hidden_layers=100_000), "4"),
}


def stage_cases() -> list[Case]:
    cases = []
    configs_argv = ["configs", "--registry", "{ws}/models.yaml", "--out", "{ws}/out/configs.json", "--source", "embedded"]
    activations_argv = ["activations", "--registry", "{ws}/models.yaml", "--configs", "{ws}/configs.json",
                        "--models-out", "{ws}/out/models.parquet", "--activations-out", "{ws}/out/activations.parquet",
                        "--points", "blog", "--workers", "1"]
    for name, (config, issue) in STAGE_BAD.items():
        bad = bad_entry(f"hostile/{name.replace('_', '-')}", config)
        cases.append(Case(f"stage-configs-bad_entry-{name}", "stage", configs_argv, setup=registry_with(bad),
                          outputs=("out",), timeout=T_WORK, check=configs_table_check(bad["id"]), issue=issue))
        cases.append(Case(f"stage-activations-bad_entry-{name}", "stage", activations_argv, setup=stage_inputs(bad),
                          outputs=("out",), timeout=T_WORK, check=activations_table_check(bad["id"]), issue=issue))
    cases.append(Case("stage-configs-billion_laughs", "stage_or_reject", configs_argv, setup=laughs_registry,
                      words=(r"laughs", r"alias", r"large"), outputs=("out",), timeout=T_WORK,
                      check=configs_table_check("owner/laughs"), issue="4"))
    cases.append(Case("count-registry-billion_laughs", "reject",
                      ["count", "--model", "owner/laughs", "--registry", "{ws}/models.yaml", "--json"],
                      setup=laughs_registry, words=(r"laughs", r"alias", r"large"), issue="4"))
    cases.append(Case("registry-deep_yaml", "reject", configs_argv, words=(r"models\.yaml",),
                      setup=json_file("models.yaml", "models: " + "[" * 200_000 + "]" * 200_000), outputs=("out",),
                      issue="own"))
    cases.append(Case("registry-python_tag", "reject", configs_argv, words=(r"models\.yaml",),
                      setup=json_file("models.yaml", "models: !!python/object/apply:os.system ['echo pwned']"),
                      outputs=("out",), issue="control"))
    cases.append(Case("registry-id_newline", "reject", configs_argv, words=(r"\bid\b", r"models\.yaml"),
                      setup=registry_with(bad_entry("owner/bad\nerror: fake second line", GOOD)), outputs=("out",),
                      issue="own"))
    cases.append(Case("registry-id_1mb", "stage_or_reject", configs_argv, words=(r"\bid\b", r"models\.yaml"),
                      setup=registry_with(bad_entry("owner/" + "x" * 2**20, GOOD)), outputs=("out",),
                      check=configs_table_check(None), issue="8"))
    cases.append(Case("registry-model_type_1mb", "stage_or_reject", configs_argv, words=(r"model_type",),
                      setup=registry_with(bad_entry("owner/big-type", mutated(model_type="x" * 2**20))),
                      outputs=("out",), check=configs_table_check(None), issue="8"))
    cases.append(Case("stage-configs-out_is_directory", "reject",
                      ["configs", "--registry", "{ws}/models.yaml", "--out", "{ws}/out", "--source", "embedded"],
                      words=(r"out",), setup=with_files(registry_with(bad_entry("owner/x", GOOD)),
                                                        lambda ws: write(ws / "out" / "keep.txt", "keep")),
                      issue="own"))
    # The Hub unreachable (a closed local port): one probe, then the embedded facts; never a retry per model
    # (four models: retries with backoff take about 25 s each). A fresh interpreter: the Hub's address is
    # read when huggingface_hub is imported.
    hub_env = {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_ETAG_TIMEOUT": "2",
               "HF_HUB_DOWNLOAD_TIMEOUT": "2"}
    for source in ("auto", "hub"):
        cases.append(Case(f"stage-configs-hub_unreachable-{source}", "stage_or_reject" if source == "hub" else "stage",
                          ["configs", "--registry", "{ws}/models.yaml", "--out", "{ws}/out/configs.json",
                           "--source", source], words=(r"hub", r"offline", r"reach"),
                          setup=lambda ws: write(ws / "models.yaml", yaml.safe_dump({"models": registry_entries(
                              (*GOOD_MODELS, "EleutherAI/pythia-70m", "openai-community/gpt2"))})),
                          outputs=("out",), env=hub_env, fresh=True, timeout=T_REJECT,
                          check=configs_table_check(None) if source == "auto" else None, issue="8"))
    return cases


# --- outputs never destroy input; the working directory is not an input -----------------------------

def mini_results(ws: Path, name: str = "results") -> Path:
    """A results folder with the two tables the dataset needs (copies of the committed ones)."""
    results = ws / name
    results.mkdir(parents=True)
    for table in ("models.parquet", "activations.parquet", "coefficients.json"):
        shutil.copyfile(REPO / "results" / table, results / table)
    return results


def truncated(table: str, size: Callable = lambda n: n // 2) -> Callable:
    def setup(ws: Path) -> None:
        path = mini_results(ws) / table
        data = path.read_bytes()
        path.write_bytes(data[:size(len(data))])
    return setup


def planted_configs(ws: Path, config: dict = GOOD) -> None:
    """A results/configs.json in the working directory that says Qwen2.5-1.5B is a tiny model."""
    write(ws / "results" / "configs.json", {QWEN15: {**configs_record(bad_entry(QWEN15, config)), "family": "qwen2"}})


def decoys(ws: Path) -> None:
    """What the runner's warm-up sees as its working directory: a module that read the working directory
    when imported (not when run) would read these other tiny models, so a case still sees a wrong answer."""
    decoy = mutated(hidden_size=32, intermediate_size=64)
    planted_configs(ws, decoy)
    write(ws / "models.yaml", yaml.safe_dump({"models": [bad_entry(QWEN15, decoy)]}))
    write(ws / "good.json", GOOD)


def parameters_are(expected: int) -> Callable:
    def check(outcome: dict, ws: Path) -> list:
        try:
            answer = json.loads(outcome["stdout"])
        except ValueError:
            return [f"stdout is not JSON: {outcome['stdout'][:200]!r}"]
        got = answer.get("parameters")
        return [] if got == expected else [f"confident wrong number: parameters {got}, expected {expected}"]
    return check


def output_cases() -> list[Case]:
    dataset = ["dataset", "--results", "{ws}/results", "--figures", "{ws}/nofigures"]
    figures = ["figures", "--results", "{ws}/results", "--only", "activations_vs_parameters"]
    formula = ["estimate", "--model", QWEN15, "--batch", "1", "--seq", "128", "--precision", "bf16",
               "--method", "formula", "--json"]
    return [
        Case("dataset-out_with_foreign_files", "reject", [*dataset, "--out", "{ws}/out"], words=(r"out",),
             setup=with_files(mini_results, lambda ws: write(ws / "out" / "a.txt", "keep"),
                              lambda ws: (ws / "out" / "sub").mkdir()), issue="1"),
        Case("dataset-out_equals_results", "reject", [*dataset, "--out", "{ws}/results"], words=(r"out", r"results"),
             setup=mini_results, issue="1"),
        Case("dataset-out_contains_results", "reject", [*dataset, "--out", "{ws}"], words=(r"out", r"results"),
             setup=mini_results, issue="1"),
        Case("dataset-out_is_a_file", "reject", [*dataset, "--out", "{ws}/out.txt"], words=(r"out",),
             setup=with_files(mini_results, json_file("out.txt", "keep")), issue="own"),
        Case("dataset-truncated_activations", "reject", [*dataset, "--out", "{ws}/out"], words=(r"activations\.parquet",),
             setup=truncated("activations.parquet"), outputs=("out",), issue="8"),
        Case("dataset-truncated_models", "reject", [*dataset, "--out", "{ws}/out"], words=(r"models\.parquet",),
             setup=truncated("models.parquet"), outputs=("out",), issue="own"),
        Case("dataset-empty_models", "reject", [*dataset, "--out", "{ws}/out"], words=(r"models\.parquet",),
             setup=truncated("models.parquet", lambda n: 0), outputs=("out",), issue="own"),
        Case("dataset-coefficients_deep_json", "reject", [*dataset, "--out", "{ws}/out"],
             words=(r"coefficients\.json",), outputs=("out",),
             setup=with_files(mini_results, deep_json("results/coefficients.json", "{\"a\": ")), issue="own"),
        Case("control-dataset-fresh_out", "ok", [*dataset, "--out", "{ws}/out"], setup=mini_results,
             outputs=("out",), issue="control"),
        Case("figures-truncated_activations", "reject",
             ["figures", "--results", "{ws}/results", "--only", "saved_bytes_vs_seq_len", "--out", "{ws}/out"],
             words=(r"activations\.parquet",), setup=truncated("activations.parquet"), outputs=("out",), issue="8"),
        # the activations-vs-parameters figure draws the rows its fit used (coefficients.json): a broken
        # table it does not read does not stop it
        Case("control-figures-truncated_models_unread", "ok", [*figures, "--out", "{ws}/out"],
             setup=truncated("models.parquet"), outputs=("out",), issue="control", timeout=T_WORK),
        Case("figures-results_missing", "reject", ["figures", "--results", "{ws}/nonexistent", "--out", "{ws}/out"],
             words=(r"nonexistent",), outputs=("out",), issue="8"),
        Case("figures-results_is_a_file", "reject", ["figures", "--results", "{ws}/file.txt", "--out", "{ws}/out"],
             words=(r"file\.txt",), setup=json_file("file.txt", "keep"), outputs=("out",), issue="own"),
        Case("figures-out_with_foreign_files", "ok", [*figures, "--out", "{ws}/out"],
             setup=with_files(mini_results, lambda ws: write(ws / "out" / "a.txt", "keep")),
             outputs=("out/activations_vs_parameters.png",), issue="own", timeout=T_WORK),
        Case("publish-manifest_is_directory", "reject",
             ["publish", "--dataset", "{ws}/dataset", "--coefficients", "{ws}/coefficients.json", "--repo", "owner/name",
              "--dry-run", "--manifest", "{ws}/manifest"], words=(r"manifest",),
             setup=with_files(json_file("dataset/README.md", "# card"), json_file("coefficients.json", {}),
                              directory("manifest")), issue="8"),
        Case("validate_settings-split_banana", "reject",
             ["validate-settings", "--tables", "{ws}/table.parquet=banana", "--coefficients",
              "{repo}/results/coefficients.json", "--configs", "{repo}/results/configs.json", "--simulated", "",
              "--out", "{ws}/out/settings_validation.parquet", "--summary", "{ws}/out/settings_validation.md"],
             words=(r"banana", r"split"), outputs=("out",), timeout=T_WORK,
             setup=lambda ws: shutil.copyfile(REPO / "results/lora_heldout/h100/peak_memory.parquet", ws / "table.parquet"),
             issue="8"),
        Case("cwd-formula_model_outside_checkout", "ok", formula, check=parameters_are(QWEN15_PARAMETERS), issue="7"),
        Case("cwd-formula_model_planted_configs", "ok", formula, setup=planted_configs,
             check=parameters_are(QWEN15_PARAMETERS), issue="7"),
        Case("control-cwd-formula_model_in_checkout", "ok", formula, cwd="{repo}",
             check=parameters_are(QWEN15_PARAMETERS), issue="control"),
        Case("cwd-simulate_model_planted_configs", "ok",
             ["simulate", "--model", QWEN15, "--batch", "1", "--seq", "8", "--precision", "bf16", "--json"],
             setup=planted_configs, timeout=T_WORK, check=simulate_parameters_check, issue="own"),
        Case("control-cwd-count_model_planted_registry", "ok", ["count", "--model", QWEN15, "--json"],
             setup=lambda ws: write(ws / "models.yaml", yaml.safe_dump({"models": [bad_entry(QWEN15, GOOD)]})),
             timeout=T_WORK, check=parameters_are(QWEN15_PARAMETERS), issue="control"),
    ]


def simulate_parameters_check(outcome: dict, ws: Path) -> list:
    """The simulator's answer for Qwen2.5-1.5B: its weights are N x 2 bytes in bf16, not a planted tiny model's."""
    try:
        answer = json.loads(outcome["stdout"])
    except ValueError:
        return [f"stdout is not JSON: {outcome['stdout'][:200]!r}"]
    found = [v for k, v in answer.items() if "param" in k and isinstance(v, int)]
    if found and QWEN15_PARAMETERS not in found:
        return [f"confident wrong number: {dict((k, v) for k, v in answer.items() if 'param' in k)}"]
    if answer.get("peak_bytes", 0) < 2 * QWEN15_PARAMETERS:
        return [f"confident wrong number: peak {answer.get('peak_bytes')} bytes < the bf16 weights of {QWEN15}"]
    return []


# --- the Python API ---------------------------------------------------------------------------------

API = "from pipeline.estimate import estimate, max_batch_size, max_seq_len\nfrom pipeline.activations import count\n"
P = "params=10**9, seq=128, precision='bf16'"
G = f"config={GOOD!r}"


def api_cases() -> list[Case]:
    equal = {  # numpy numbers are numbers
        "numpy_int64_batch_seq": f"result = {{'got': estimate(params=10**9, batch=np.int64(4), seq=np.int64(128), "
                                 f"precision='bf16')['peak_bytes'], 'want': estimate(params=10**9, batch=4, seq=128, "
                                 f"precision='bf16')['peak_bytes']}}",
        "numpy_int64_params": "result = {'got': estimate(params=np.int64(10**9), batch=1, seq=128, precision='bf16')"
                              "['peak_bytes'], 'want': estimate(params=10**9, batch=1, seq=128, precision='bf16')['peak_bytes']}",
        "numpy_float64_gpu_memory": f"result = {{'got': estimate({P}, batch=1, gpu_memory_gib=np.float64(79.6))"
                                    f"['headroom_bytes'], 'want': estimate({P}, batch=1, gpu_memory_gib=79.6)['headroom_bytes']}}",
        "numpy_int64_max_batch_size": f"result = {{'got': max_batch_size(params=10**9, seq=np.int64(512), precision='bf16', "
                                      f"gpu_memory_gib=80), 'want': max_batch_size(params=10**9, seq=512, precision='bf16', "
                                      f"gpu_memory_gib=80)}}",
        "numpy_int64_max_seq_len": f"result = {{'got': max_seq_len(params=10**9, batch=np.int64(2), precision='bf16', "
                                   f"gpu_memory_gib=80), 'want': max_seq_len(params=10**9, batch=2, precision='bf16', "
                                   f"gpu_memory_gib=80)}}",
        "numpy_int64_exact": f"result = {{'got': estimate({G}, batch=np.int64(2), seq=np.int64(16), precision='fp32', "
                             f"method='exact')['peak_bytes'], 'want': estimate({G}, batch=2, seq=16, precision='fp32', "
                             f"method='exact')['peak_bytes']}}",
        "numpy_int64_formula_lora": f"result = {{'got': estimate({G}, batch=np.int64(2), seq=16, precision='bf16', "
                                    f"method='formula', lora_r=np.int64(8))['peak_bytes'], 'want': estimate({G}, batch=2, "
                                    f"seq=16, precision='bf16', method='formula', lora_r=8)['peak_bytes']}}",
        "numpy_int64_in_config": f"result = {{'got': estimate(config={{**{GOOD!r}, 'hidden_size': np.int64(64)}}, batch=1, "
                                 f"seq=16, precision='bf16')['peak_bytes'], 'want': estimate({G}, batch=1, seq=16, "
                                 f"precision='bf16')['peak_bytes']}}",
        "numpy_int64_count": "import json as _j; open('good.json', 'w').write(_j.dumps(" + repr(GOOD) + "))\n"
                             "result = {'got': count(config='good.json', batch=np.int64(1), seq=np.int64(8))['saved_bytes'], "
                             "'want': count(config='good.json', batch=1, seq=8)['saved_bytes']}",
    }
    reject = {  # (call, words, issue)
        "checkpointing_string_no": (f"estimate({P}, batch=1, checkpointing='no')", (r"checkpointing",), "6"),
        "checkpointing_string_false": (f"estimate({P}, batch=1, checkpointing='false')", (r"checkpointing",), "6"),
        "expandable_segments_string": (f"estimate({P}, batch=1, expandable_segments='no')", (r"expandable",), "own"),
        "gpu_memory_bool": (f"estimate({P}, batch=1, gpu_memory_gib=True)", (r"gpu_memory",), "6"),
        "gpu_memory_string": (f"estimate({P}, batch=1, gpu_memory_gib='80')", (r"gpu_memory",), "own"),
        "gpu_memory_nan": (f"estimate({P}, batch=1, gpu_memory_gib=float('nan'))", (r"gpu_memory",), "own"),
        "gpu_memory_inf": (f"estimate({P}, batch=1, gpu_memory_gib=float('inf'))", (r"gpu_memory",), "own"),
        "gpu_memory_negative": (f"estimate({P}, batch=1, gpu_memory_gib=-1)", (r"gpu_memory",), "own"),
        "gpu_memory_zero": (f"estimate({P}, batch=1, gpu_memory_gib=0)", (r"gpu_memory",), "own"),
        "params_bool": ("estimate(params=True, batch=1, seq=128, precision='bf16')", (r"params",), "6"),
        "params_nan": ("estimate(params=float('nan'), batch=1, seq=128, precision='bf16')", (r"params",), "control"),
        "params_zero": ("estimate(params=0, batch=1, seq=128, precision='bf16')", (r"params",), "control"),
        "batch_bool": (f"estimate({P}, batch=True)", (r"batch",), "6"),
        "batch_float": (f"estimate({P}, batch=2.5)", (r"batch",), "own"),
        "batch_nan": (f"estimate({P}, batch=float('nan'))", (r"batch",), "own"),
        "batch_zero": (f"estimate({P}, batch=0)", (r"batch",), "own"),
        "batch_negative": (f"estimate({P}, batch=-1)", (r"batch",), "own"),
        "seq_bool": ("estimate(params=10**9, batch=1, seq=True, precision='bf16')", (r"seq",), "6"),
        "seq_inf": ("estimate(params=10**9, batch=1, seq=float('inf'), precision='bf16')", (r"seq",), "own"),
        "seq_string": ("estimate(params=10**9, batch=1, seq='128', precision='bf16')", (r"seq",), "own"),
        "lora_r_bool": (f"estimate({G}, batch=1, seq=16, precision='bf16', method='formula', lora_r=True)",
                        (r"lora_r", r"\br\b"), "own"),
        "lora_r_zero": (f"estimate({G}, batch=1, seq=16, precision='bf16', method='formula', lora_r=0)",
                        (r"lora_r", r"\br\b"), "own"),
        "lora_r_float": (f"estimate({G}, batch=1, seq=16, precision='bf16', method='formula', lora_r=2.5)",
                         (r"lora_r", r"\br\b"), "own"),
        "num_gpus_bool": (f"estimate({P}, batch=1, num_gpus=True, sharding='ddp')", (r"num_gpus", r"gpus"), "own"),
        "num_gpus_zero": (f"estimate({P}, batch=1, num_gpus=0, sharding='ddp')", (r"num_gpus", r"gpus"), "own"),
        "accumulation_bool": (f"estimate({P}, batch=1, client='trainer', gradient_accumulation=True)",
                              (r"accumulation",), "own"),
        "accumulation_zero": (f"estimate({P}, batch=1, client='trainer', gradient_accumulation=0)",
                              (r"accumulation",), "own"),
        "config_hidden_bool_heuristic": (f"estimate(config={{**{GOOD!r}, 'hidden_size': True}}, batch=1, seq=16, "
                                         f"precision='bf16')", (r"hidden_size",), "own"),
        "config_hidden_bool_formula": (f"estimate(config={{**{GOOD!r}, 'hidden_size': True}}, batch=1, seq=16, "
                                       f"precision='bf16', method='formula')", (r"hidden_size",), "own"),
        "config_hidden_numpy_float": (f"estimate(config={{**{GOOD!r}, 'hidden_size': np.float64(64.5)}}, batch=1, "
                                      f"seq=16, precision='bf16', method='exact')", (r"hidden_size",), "own"),
        "config_kv_heads_3_of_16_exact": (f"estimate(config={{**{GOOD!r}, 'num_attention_heads': 16, "
                                          f"'num_key_value_heads': 3}}, batch=1, seq=16, precision='bf16', method='exact')",
                                          (r"key_value", r"kv", r"heads"), "5"),
        "config_not_a_dict": ("estimate(config=42, batch=1, seq=16, precision='bf16')", (r"config",), "own"),
        "config_dev_zero": ("estimate(config='/dev/zero', batch=1, seq=16, precision='bf16')", (r"/dev/zero",), "own"),
        "training_args_bf16_string": (f"estimate(params=10**9, seq=128, training_args={{'bf16': 'false', "
                                      f"'per_device_train_batch_size': 1}})", (r"bf16",), "6"),
        "training_args_checkpointing_string": (f"estimate(params=10**9, seq=128, training_args={{'bf16': True, "
                                               f"'gradient_checkpointing': 'no', 'per_device_train_batch_size': 1}})",
                                               (r"gradient_checkpointing",), "6"),
        "max_batch_size_gpu_memory_bool": ("max_batch_size(params=10**9, seq=128, precision='bf16', gpu_memory_gib=True)",
                                           (r"gpu_memory",), "6"),
        "max_seq_len_batch_bool": ("max_seq_len(params=10**9, batch=True, precision='bf16', gpu_memory_gib=80)",
                                   (r"batch",), "6"),
        "count_batch_bool": ("import json as _j; open('good.json', 'w').write(_j.dumps(" + repr(GOOD) + "))\n"
                             "count(config='good.json', batch=True, seq=8)", (r"batch",), "6"),
        "count_deep_json": ("open('deep.json', 'w').write('[' * 200000 + ']' * 200000)\ncount(config='deep.json')",
                            (r"deep\.json",), "3"),
        "count_model_newline": ("count(model='a/b\\nerror: fake second line')", (r"model",), "own"),
        "method_unknown": (f"estimate({P}, batch=1, method='Exact')", (r"method",), "control"),
    }
    cases = [Case(f"api-{name}", "api_equal", code=API + code, issue="6") for name, code in equal.items()]
    for name, (call, words, issue) in reject.items():
        lines = call.splitlines()
        code = API + "\n".join(lines[:-1] + [f"result = {lines[-1]}"])
        cases.append(Case(f"api-{name}", "api_reject", code=code, words=words, issue=issue,
                          outputs=("good.json", "deep.json")))
    for case in cases:
        case.heavy = "dev_zero" in case.id
        case.outputs = ("good.json", "deep.json")
        if "exact" in case.id or "count" in case.id:
            case.timeout = T_WORK
        # a count's CPU forward after a fork from the warmed-up process hangs in OpenMP (a harness
        # artifact: a real `count` call starts its own process): it runs in a fresh interpreter
        case.fresh = case.id == "api-numpy_int64_count"
    return cases


CASES = [*bad_config_cases(), *numeric_cases(), *settings_file_cases(), *option_cases(), *stage_cases(),
         *output_cases(), *api_cases()]
BY_ID = {case.id: case for case in CASES}
assert len(BY_ID) == len(CASES), "case ids must be unique"


# --- running and judging ------------------------------------------------------------------------------

def snapshot(root: Path) -> dict:
    """{relative path: what it is} for everything under root; FIFOs and devices are never opened."""
    found = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder) / name
            info = path.lstat()
            rel = path.relative_to(root).as_posix()
            if stat.S_ISREG(info.st_mode):
                digest = hashlib.sha1()
                with open(path, "rb") as handle:
                    for block in iter(lambda: handle.read(1 << 20), b""):
                        digest.update(block)
                found[rel] = ("file", info.st_size, digest.hexdigest())
            elif stat.S_ISDIR(info.st_mode):
                found[rel] = ("dir",)
            elif stat.S_ISLNK(info.st_mode):
                found[rel] = ("link", os.readlink(path))
            else:
                found[rel] = ("special", stat.S_IFMT(info.st_mode))
    return found


def touched(before: dict, after: dict, outputs: tuple) -> list:
    def owned(rel: str) -> bool:
        return any(rel == out or rel.startswith(out.rstrip("/") + "/") for out in outputs)

    problems = []
    for rel in sorted(set(before) | set(after)):
        if owned(rel) or before.get(rel) == after.get(rel):
            continue
        what = "deleted" if rel not in after else "created" if rel not in before else "changed"
        problems.append(f"{what} outside its output: {rel}")
    return problems


def exception_line(lines: list) -> str:
    """The line of a traceback that names the exception (the last such; C++ frames may follow it)."""
    for line in reversed(lines):
        if re.match(r"[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b", line):
            return line
    return lines[-1] if lines else ""


def calibrated_slowdown() -> float:
    """How many times slower this machine runs a fixed piece of Python now than an idle 2-core machine did (at
    least 1, at most 8): the best of three runs, each in a child process, as the cases run."""
    times = []
    for _ in range(3):
        done = subprocess.run([sys.executable, "-c", CALIBRATION], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0 and done.stdout.strip(), done.stderr[-500:]
        times.append(float(done.stdout.strip()))
    return min(max(min(times) / REFERENCE_WORK_SECONDS, 1.0), 8.0)


def stderr_lines(outcome: dict) -> list:
    return [line for line in outcome["stderr"].splitlines() if line.strip()]


def judge(case: Case, outcome: dict, ws: Path, before: dict) -> list:
    """The problems of one outcome (empty: the case passes)."""
    if outcome is None:
        return ["no outcome (the runner died)"]
    problems = []
    limit = outcome.get("timeout") or case.timeout + (FRESH_EXTRA if outcome.get("fresh") else 0)
    if outcome["timed_out"]:
        problems.append(f"hang: killed after {limit:.0f} s")
    if outcome["rc"] < 0 and not outcome["timed_out"]:
        problems.append(f"killed by signal {-outcome['rc']}")
    lines = stderr_lines(outcome)
    if "Traceback (most recent call last)" in outcome["stderr"]:
        problems.append(f"traceback: {exception_line(lines)[:300]}")
    if "MemoryError" in outcome["stderr"] and not any(p.startswith("traceback") for p in problems):
        problems.append("MemoryError")
    if case.kind == "api":
        problems += judge_api(case, outcome)
    else:
        problems += judge_cli(case, outcome, lines)
    problems += touched(before, snapshot(ws), case.outputs)
    if case.check and not outcome["timed_out"] and outcome["rc"] >= 0:
        try:
            problems += case.check(outcome, ws)
        except Exception as exc:  # noqa: BLE001 - a broken output is a finding, not a test error
            problems.append(f"output unreadable: {type(exc).__name__}: {str(exc)[:200]}")
    return problems


def one_line_problems(lines: list, words: tuple, what: str = "stderr") -> list:
    problems = []
    if len(lines) != 1:
        problems.append(f"{what} has {len(lines)} non-empty lines, not 1" + (f": {lines[0][:150]!r}..." if lines else ""))
        return problems
    line = lines[0]
    if len(line) >= MAX_LINE:
        problems.append(f"line of {len(line)} chars: {line[:150]!r}...")
    if any(ord(ch) < 32 and ch != "\t" for ch in line):
        problems.append(f"control characters in the line: {line[:150]!r}")
    if words and not any(re.search(word.replace("_", "[-_ ]"), line, re.I) for word in words):  # hidden_size: "hidden size"
        problems.append(f"line does not name the problem ({' | '.join(words)}): {line[:200]!r}")
    return problems


def judge_cli(case: Case, outcome: dict, lines: list) -> list:
    rc = outcome["rc"]
    if outcome["timed_out"] or rc < 0:
        return []
    if case.expect == "reject":
        if rc != 2:
            first = next((line for line in lines if line.strip()), "")
            return [f"exit {rc}, not 2" + (" (accepted: an answer for bad input)" if rc == 0 else "")
                    + (f": {first[:200]!r}" if rc != 1 else "")]
        return one_line_problems(lines, case.words)
    if case.expect == "clean":
        if rc == 2:
            return one_line_problems(lines, ())
        if rc != 0:
            return [f"exit {rc}, not 0 or 2"]
        return finite_answer(outcome)
    if case.expect == "ok":
        return [] if rc == 0 else [f"exit {rc}, not 0: {(lines or [''])[-1][:200]!r}"]
    if case.expect in ("stage", "stage_or_reject"):
        if rc == 2 and case.expect == "stage_or_reject":
            return one_line_problems(lines, case.words)
        if rc not in (0, 1):
            return [f"exit {rc}, not 0 or 1: {(lines or [''])[-1][:200]!r}"]
        return []
    raise AssertionError(case.expect)


def finite_answer(outcome: dict) -> list:
    """A JSON answer (when there is one) has no NaN, inf or negative byte counts."""
    try:
        answer = json.loads(outcome["stdout"])
    except ValueError:
        return []
    bad = [k for k, v in answer.items() if isinstance(v, float) and not math.isfinite(v)
           or k.endswith("_bytes") and isinstance(v, (int, float)) and v < 0]
    return [f"confident wrong number: {k} = {answer[k]}" for k in bad[:3]]


def judge_api(case: Case, outcome: dict) -> list:
    api = outcome.get("api")
    if outcome["timed_out"] or outcome["rc"] < 0:
        return []
    if api is None:
        return [f"no result (exit {outcome['rc']}): {(stderr_lines(outcome) or [''])[-1][:200]!r}"]
    if case.expect == "api_reject":
        if api["raised"] is None:
            return [f"accepted: returned {json.dumps(api['value'])[:200]}"]
        module = api["raised"].rsplit(".", 1)[0]
        if not (module.startswith("pipeline") or module == "builtins" and api["value_or_type_error"]):
            return [f"raised {api['raised']}: {api['message'].splitlines()[0][:200] if api['message'] else ''!r}"]
        return one_line_problems(api["message"].splitlines() or [""], case.words, "the message")
    if api["raised"] is not None:
        return [f"raised {api['raised']}: {(api['message'].splitlines() or [''])[0][:200]!r}"]
    if case.expect == "api_equal":
        value = api["value"]
        return [] if value["got"] == value["want"] else [f"different answer: {value['got']} != {value['want']}"]
    return []


# Commands run once before the cases are forked (their imports are then shared): the public entry point.
WARM = [["--help"],
        ["estimate", "--config", "good.json", "--batch", "1", "--seq", "8", "--precision", "fp32", "--method", "exact"],
        ["count", "--config", "good.json", "--batch", "1", "--seq", "8"]]


def selected_ids(session) -> list:
    ids = []
    for item in session.items:
        callspec = getattr(item, "callspec", None)
        if item.module.__name__ == __name__ and callspec and "case_id" in callspec.params:
            ids.append(callspec.params["case_id"])
    return ids or list(BY_ID)


def subprocess_env(home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(home / "hf"), MPLCONFIGDIR=str(home / "mpl"),
               MPLBACKEND="Agg", AVP_GIT_COMMIT="test-hostile", PYTHONDONTWRITEBYTECODE="1",
               PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    return env


def substitute(value, ws: Path):
    if isinstance(value, list):
        return [substitute(v, ws) for v in value]
    return value.replace("{ws}", str(ws)).replace("{repo}", str(REPO))


@pytest.fixture(scope="module")
def outcomes(request, tmp_path_factory):
    """Every selected case run once (concurrently, each bounded), judged; {id: (problems, outcome)}."""
    root = tmp_path_factory.mktemp("hostile")
    ids = selected_ids(request.session)
    repo_before = {"results": snapshot(REPO / "results"), "models.yaml": (REPO / "models.yaml").read_bytes()}
    specs, befores = [], {}
    slowdown = calibrated_slowdown()
    folders = {case_id: root / f"c{index:04d}" for index, case_id in enumerate(ids)}  # no words of the id in paths
    for case_id in ids:
        case = BY_ID[case_id]
        ws, io = folders[case_id] / "ws", folders[case_id] / "io"
        ws.mkdir(parents=True)
        if case.setup:
            case.setup(ws)
        befores[case_id] = snapshot(ws)
        spec = {"id": case_id, "kind": case.kind, "cwd": substitute(case.cwd, ws), "case_dir": str(io),
                "env": case.env, "fresh": case.fresh, "heavy": case.heavy, "mem": MEM,
                "timeout": (case.timeout + (FRESH_EXTRA if FRESH or case.fresh else 0)) * slowdown}
        if case.kind == "cli":
            spec["argv"] = substitute(case.argv, ws)
        else:
            spec["code"] = case.code
        specs.append(spec)
    # Many cases wait (a FIFO, a killed hang); a heavy one runs alone among the heavy.
    jobs = int(os.environ.get("HOSTILE_JOBS", max(4, min(8, 2 * (os.cpu_count() or 2)))))
    warm_cwd = root / "warm"
    decoys(warm_cwd)
    # The slowest first, so that they overlap the many quick ones.
    specs.sort(key=lambda s: -s["timeout"])
    spec_path = root / "spec.json"
    spec_path.write_text(json.dumps({"jobs": jobs, "heavy_jobs": 1, "fresh": FRESH, "cases": specs,
                                     "warm_cwd": str(warm_cwd), "warm": WARM, "preimport": [
        "numpy", "pandas", "pyarrow.parquet", "yaml", "jsonschema", "sklearn", "matplotlib", "torch",
        "transformers", "peft", "pipeline.estimate", "pipeline.activations"]}))
    result_path = root / "outcomes.json"
    done = subprocess.run([sys.executable, str(RUNNER), str(spec_path), str(result_path)], env=subprocess_env(root),
                          capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, done.stderr[-3000:]
    raw = json.loads(result_path.read_text())
    judged = {}
    for case_id in ids:
        ws = folders[case_id] / "ws"
        judged[case_id] = (judge(BY_ID[case_id], raw.get(case_id), ws, befores[case_id]), raw.get(case_id))
    judged["__repo__"] = (touched(repo_before["results"], snapshot(REPO / "results"), ())
                          + ([] if (REPO / "models.yaml").read_bytes() == repo_before["models.yaml"]
                             else ["changed: models.yaml"]), None)
    report = os.environ.get("HOSTILE_REPORT")
    if report:
        Path(report).write_text(json.dumps({
            case_id: {"issue": BY_ID[case_id].issue if case_id in BY_ID else "", "problems": problems,
                      **({k: outcome.get(k) for k in ("rc", "seconds", "timed_out", "maxrss_kib", "cpu_user", "cpu_sys")} if outcome else {}),
                      "stderr_last": (stderr_lines(outcome) or [""])[-1][:400] if outcome else "",
                      "api": outcome.get("api") if outcome else None}
            for case_id, (problems, outcome) in judged.items()}, indent=1))
    return judged


@pytest.mark.parametrize("case_id", list(BY_ID))
def test_hostile(case_id, outcomes):
    problems, outcome = outcomes[case_id]
    case = BY_ID[case_id]
    what = json.dumps(case.argv)[:300] if case.argv else json.dumps(case.code[len(API):])[:300]
    assert not problems, f"{case_id} ({case.kind}: {what})\n  " + "\n  ".join(problems)


def test_repository_untouched(outcomes):
    """No case changed the repository's results/ or models.yaml (every case has its own outputs)."""
    problems, _ = outcomes["__repo__"]
    assert not problems, problems
