"""A question to the server: the keyword arguments of `pipeline.estimate.estimate` (plus one search:
`"max_batch_size"`, `"max_seq_len"`, `"layouts"` or `"min_gpus"`: true), checked before anything runs, and its
answer, which is what `python -m pipeline estimate ... --json` prints for the same options (`--max-batch-size`,
`--max-seq-len`, `--layouts`, `--min-gpus`).

What the server refuses that the command line allows (one `UserError` line each, HTTP 400): a path
where the library takes a path or a dict (`config`, `training_args`, `peft_config`, `sft_config`,
`accelerate_config`, `deepspeed`: the server reads no file of its host, it takes their JSON objects; nor a path
inside one), another coefficient
file, an attention implementation other than the library's default, sdpa or eager (a named kernel may be
fetched from the Hub), and questions beyond `LIMITS`. `lengths` (the command's `--lengths FILE`) is the JSON list of
the documents' token counts (in a URL's query: joined by commas), taken with the estimate and its searches, not with
the layouts. `min_gpus` without `num_gpus` searches up to the
server's limit of GPUs (the command's default is the library's, `vocabulary.MAX_GPUS`).
"""

from __future__ import annotations

import inspect
import json
import math

from pipeline.core.errors import UserError
from pipeline.core.vocabulary import MAX_LORA_RANK, MAX_TOKENS, ROLLOUT_CLIENTS
from pipeline.training.rollout import DEFAULT_PROMPT_LENGTH

# The server's caps (one line in docs/serve.md): the body of a request, and, tighter than the library's
# own limits (core.vocabulary: tokens of one step, LoRA rank), the GPU's memory (which bounds the
# searches), the GPUs of a sharded run and the micro-batches of one step.
MAX_BODY_BYTES = 1 << 20
MAX_GPU_MEMORY_GIB = 1024
MAX_NUM_GPUS = 1024
MAX_GRADIENT_ACCUMULATION = 64
MAX_GENERATIONS = 64  # GRPO's completions per prompt
MAX_COMPLETION = 32768  # GRPO's tokens per completion
MAX_LENGTHS = 1_000_000  # a dataset's document lengths (`lengths`: its worst step)
LIMITS = (f"the server refuses a request body over {MAX_BODY_BYTES >> 20} MiB, batch x seq over {MAX_TOKENS:,} "
          f"tokens, a GPU over {MAX_GPU_MEMORY_GIB} GiB, more than {MAX_NUM_GPUS} GPUs, gradient accumulation "
          f"over {MAX_GRADIENT_ACCUMULATION}, a LoRA rank over {MAX_LORA_RANK}, more than {MAX_GENERATIONS} "
          f"completions per prompt, completions over {MAX_COMPLETION:,} tokens and more than {MAX_LENGTHS:,} "
          "document lengths")

SEARCHES = ("max_batch_size", "max_seq_len", "layouts", "min_gpus")
# The layouts' searches vary the layout themselves: the command drops these of the question (estimate/cli.py).
LAYOUT_FIELDS = ("sharding", "shard_group", "tensor_parallel")
# Fields the server will not take from a request, and why.
REFUSED = {"coefficients": "the server answers with its own coefficient file",
           "dataset": "it reads no file of its host and fetches no dataset: send the documents' token counts (lengths)",
           "tokenizer": "it loads no tokenizer: send the documents' token counts (lengths)"}
# Fields that are JSON objects (the library also takes a path: the server does not).
OBJECTS = ("config", "training_args", "peft_config", "sft_config", "accelerate_config", "deepspeed", "grpo_config",
           "axolotl_config", "llamafactory_config")
# Framework files the page pastes as they are: their YAML text is taken too (Axolotl's lists need a real parser).
YAML_TEXT_FIELDS = ("axolotl_config", "llamafactory_config")
MAX_YAML_TEXT = 64 << 10
INTEGERS = ("batch", "seq", "num_gpus", "shard_group", "tensor_parallel", "gradient_accumulation", "lora_r",
            "lora_alpha", "num_generations", "max_completion_length")
BOOLEANS = ("checkpointing", "expandable_segments", "liger_kernel", "use_vllm", "packing", "padding_free", *SEARCHES)
NUMBERS = ("gpu_memory_gib", "beta", "vllm_gpu_memory_utilization", "lora_dropout")
ATTENTION = (None, "sdpa", "eager")  # the library's default, or one of torch's own kernels


def estimate_fields() -> tuple[str, ...]:
    """The keyword arguments of `estimate` (a new option of the library is a new field here)."""
    from pipeline.estimate import estimate

    return tuple(name for name in inspect.signature(estimate).parameters)


def fields() -> tuple[str, ...]:
    return (*estimate_fields(), *SEARCHES)


def check(question) -> dict:
    """The question as keyword arguments, or a one-line UserError; None values are left out."""
    if not isinstance(question, dict):
        raise UserError("the request must be a JSON object of estimate's keyword arguments")
    known = fields()
    for name in question:
        if name in REFUSED:
            raise UserError(f"field {name!r} is not taken by the server: {REFUSED[name]}")
        if name not in known:
            raise UserError(f"unknown field {name!r}; the fields are estimate's keyword arguments: "
                            f"{', '.join(n for n in known if n not in REFUSED)}")
    q = {name: value for name, value in question.items() if value is not None}
    for name in YAML_TEXT_FIELDS:
        if isinstance(q.get(name), str) and ("\n" in q[name] or ": " in q[name]):
            q[name] = yaml_mapping(q[name], name)
    for name in OBJECTS:
        if name in q and not isinstance(q[name], dict):
            raise UserError(f"{name} must be a JSON object (the content of the file); the server reads no paths")
    for name in ("training_args", "sft_config", "grpo_config", "axolotl_config", "llamafactory_config"):
        if isinstance(q.get(name, {}).get("deepspeed"), str):
            raise UserError(f"{name}'s deepspeed names a file; the server reads no paths: give the DeepSpeed config "
                            "as the deepspeed object")
    if isinstance(q.get("accelerate_config", {}).get("deepspeed_config"), dict) \
            and q["accelerate_config"]["deepspeed_config"].get("deepspeed_config_file"):
        raise UserError("accelerate_config's deepspeed_config_file names a file; the server reads no paths: give the "
                        "DeepSpeed config as the deepspeed object")
    for name in BOOLEANS:
        if name in q and not isinstance(q[name], bool):
            raise UserError(f"{name} must be true or false, not {q[name]!r}")
    for name in INTEGERS:
        if name in q and (not isinstance(q[name], int) or isinstance(q[name], bool) or q[name] <= 0):
            raise UserError(f"{name} must be a positive integer, not {q[name]!r}")
    if "lengths" in q:
        check_lengths(q)
    if "lora_targets" in q and not (isinstance(q["lora_targets"], str) or (
            isinstance(q["lora_targets"], list) and all(isinstance(t, str) for t in q["lora_targets"]))):
        raise UserError("lora_targets must be all-linear or module names joined by commas")
    if q.get("attn_implementation") not in ATTENTION:
        raise UserError(f"attn_implementation {q['attn_implementation']!r} is not one of sdpa, eager "
                        "(or left out: the library's default)")
    for name in ("model", "gpu", "precision", "method", "client", "optimizer", "optim", "sharding", "quantization",
                 "vllm_mode"):
        if name in q and not isinstance(q[name], str):
            raise UserError(f"{name} must be a string, not {q[name]!r}")
    searches = [name for name in SEARCHES if q.get(name)]
    if len(searches) > 1:
        raise UserError(f"ask for one of {', '.join(SEARCHES)}, not both {searches[0]} and {searches[1]}")
    if searches and "gpu" not in q and "gpu_memory_gib" not in q:
        raise UserError(f"{searches[0]} needs the GPU: gpu (a name) or gpu_memory_gib")
    if "seq" not in q and not q.get("max_seq_len") and q.get("client") not in ROLLOUT_CLIENTS and not any(
            name in q for name in ("sft_config", "axolotl_config", "llamafactory_config", "grpo_config")):
        raise UserError("seq is required (unless max_seq_len, or a training file with its length)")
    if q.get("layouts") or q.get("min_gpus"):
        check_layouts_question(q)
    check_limits(q)
    return q


def yaml_mapping(text: str, name: str) -> dict:
    """A framework file's YAML text as its mapping; one line for bad YAML, and for aliases (a few lines of them
    expand to gigabytes once the answer echoes the file)."""
    import yaml

    from pipeline.core.io import MAX_DEPTH, parse_yaml

    # PyYAML's parser is slow on deep brackets and long texts, and the check runs before any time limit
    if len(text) > MAX_YAML_TEXT:
        raise UserError(f"{name}: over {MAX_YAML_TEXT >> 10} KiB of YAML (a framework file is a few kB)")
    depth = deepest = 0
    for char in text:
        depth += 1 if char in "[{" else -1 if char in "]}" else 0
        deepest = max(deepest, depth)
    if deepest > MAX_DEPTH:
        raise UserError(f"{name}: nested more than {MAX_DEPTH} levels deep")
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        aliased = any(isinstance(event, yaml.AliasEvent) for event in yaml.parse(text, Loader=loader))
    except yaml.YAMLError:
        aliased = False  # parse_yaml says what is wrong
    if aliased:
        raise UserError(f"{name}: YAML aliases (*name) are not taken by the server: write the values out")
    data = parse_yaml(text, name, "not valid YAML: paste the file as it is")
    if not isinstance(data, dict):
        raise UserError(f"{name} must be the file's YAML mapping of its keys")
    return data


def check_lengths(q: dict) -> None:
    """A dataset's document lengths (the answer's worst step): a JSON list of 1 to MAX_LENGTHS whole numbers from 1
    (`training.packing.check_lengths`), checked before any simulation runs."""
    from pipeline.training.packing import check_lengths as check_token_counts

    lengths = q["lengths"]
    if not isinstance(lengths, list):
        raise UserError(f"lengths must be a JSON list of the documents' token counts, not {type(lengths).__name__}")
    if not lengths or len(lengths) > MAX_LENGTHS:
        raise UserError(f"lengths must list from 1 to {MAX_LENGTHS:,} token counts (the server's limit), not "
                        f"{len(lengths):,}")
    check_token_counts(lengths)


def check_layouts_question(q: dict) -> None:
    """A field `pipeline.estimate.layouts` does not take is refused (the layout fields are the table's);
    min_gpus searches up to num_gpus, by default the server's limit."""
    from pipeline.estimate import layouts

    if "lengths" in q:
        raise UserError("lengths is not taken with layouts or min_gpus (a dataset's worst step is the estimate's and "
                        "the batch and sequence searches'): ask without it")
    taken = inspect.signature(layouts).parameters
    for name in q:
        if name not in taken and name not in (*LAYOUT_FIELDS, *SEARCHES):
            raise UserError(f"{name} is not taken with layouts or min_gpus (the table varies the layout): "
                            "ask without it")
    if q.get("min_gpus") and "num_gpus" not in q:
        q["num_gpus"] = MAX_NUM_GPUS  # the server's limit, not the library's


def check_limits(q: dict) -> None:
    batch, seq = q.get("batch", 1), q.get("seq", DEFAULT_PROMPT_LENGTH if q.get("client") in ROLLOUT_CLIENTS else 1)
    if batch * seq > MAX_TOKENS:
        raise UserError(f"batch x seq = {batch * seq:,} tokens is over the server's limit of {MAX_TOKENS:,}")
    gib = q.get("gpu_memory_gib")
    if isinstance(gib, (int, float)) and not isinstance(gib, bool) and math.isfinite(gib) and gib > MAX_GPU_MEMORY_GIB:
        raise UserError(f"gpu_memory_gib {gib:g} is over the server's limit of {MAX_GPU_MEMORY_GIB} GiB")
    for name, most in (("num_gpus", MAX_NUM_GPUS), ("shard_group", MAX_NUM_GPUS), ("tensor_parallel", MAX_NUM_GPUS),
                       ("gradient_accumulation", MAX_GRADIENT_ACCUMULATION), ("lora_r", MAX_LORA_RANK),
                       ("num_generations", MAX_GENERATIONS), ("max_completion_length", MAX_COMPLETION)):
        if q.get(name, 0) > most:
            raise UserError(f"{name} {q[name]} is over the server's limit of {most}")
    check_file_limits(q)
    processes = q.get("accelerate_config", {}).get("num_processes")
    if isinstance(processes, int) and processes > MAX_NUM_GPUS:
        raise UserError(f"accelerate_config's num_processes {processes} is over the server's limit of {MAX_NUM_GPUS} "
                        "GPUs")


# The same caps on the numbers a training file gives (its keys by the file's own names): the question's field each
# stands for, whose cap applies.
FILE_FIELDS = {
    "training_args": {"per_device_train_batch_size": "batch", "gradient_accumulation_steps": "gradient_accumulation"},
    "sft_config": {"per_device_train_batch_size": "batch", "max_length": "seq",
                   "gradient_accumulation_steps": "gradient_accumulation"},
    "grpo_config": {"per_device_train_batch_size": "batch", "gradient_accumulation_steps": "gradient_accumulation",
                    "num_generations": "num_generations", "max_completion_length": "max_completion_length",
                    "max_prompt_length": "seq"},
    "axolotl_config": {"micro_batch_size": "batch", "sequence_len": "seq",
                       "gradient_accumulation_steps": "gradient_accumulation", "num_generations": "num_generations",
                       "max_completion_length": "max_completion_length"},
    "llamafactory_config": {"per_device_train_batch_size": "batch", "cutoff_len": "seq",
                            "gradient_accumulation_steps": "gradient_accumulation"},
}
FIELD_CAPS = {"batch": MAX_TOKENS, "seq": MAX_TOKENS, "gradient_accumulation": MAX_GRADIENT_ACCUMULATION,
              "num_generations": MAX_GENERATIONS, "max_completion_length": MAX_COMPLETION}


def check_file_limits(q: dict) -> None:
    """A training file's numbers under the caps of the fields they stand for (Axolotl's GRPO keys sit under trl:)."""
    for name, keys in FILE_FIELDS.items():
        given = q.get(name)
        if not isinstance(given, dict):
            continue
        values = {**given, **(given["trl"] if isinstance(given.get("trl"), dict) else {})}
        for key, field in keys.items():
            value = values.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > FIELD_CAPS[field]:
                raise UserError(f"{name}'s {key} {value:g} is over the server's limit of {FIELD_CAPS[field]:,} "
                                f"({field})")


def from_query(params) -> dict:
    """A question from a URL's query (GET /api/estimate?model=...&batch=4): the same fields, as text."""
    question = {}
    for name, text in params.items():
        if name in OBJECTS:
            raise UserError(f"{name} is a JSON object: POST it to /api/estimate")
        if name == "lengths":
            try:
                question[name] = [int(count) for count in text.split(",")]
            except ValueError:
                raise UserError("lengths must be token counts joined by commas (or POST a JSON list)") from None
        elif name in INTEGERS:
            try:
                question[name] = int(text)
            except ValueError:
                raise UserError(f"{name} must be a positive integer, not {text!r}") from None
        elif name in NUMBERS:
            try:
                question[name] = float(text)
            except ValueError:
                raise UserError(f"{name} must be a number, not {text!r}") from None
        elif name in BOOLEANS:
            if text.lower() not in ("true", "false", "1", "0", ""):
                raise UserError(f"{name} must be true or false, not {text!r}")
            question[name] = text.lower() in ("true", "1", "")
        else:
            question[name] = text
    return question


def parse_body(body: bytes):
    if len(body) > MAX_BODY_BYTES:
        raise UserError(f"the request is over the server's limit of {MAX_BODY_BYTES >> 20} MiB")
    from pipeline.core.io import check_depth

    try:
        question = json.loads(body)
    except RecursionError:
        raise UserError("the request is nested too deeply to read") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"the request is not JSON ({exc.__class__.__name__}: {str(exc).splitlines()[0]})") from None
    check_depth(question, "the request")
    return question


def needs_torch(q: dict) -> bool:
    """Whether the answer builds the model (torch, transformers): every method but the formula,
    unless a parameter count is all it is given."""
    return q.get("method", "heuristic") != "formula" and "params" not in q


def answer(q: dict) -> dict:
    """The answer to a checked question: what `estimate ... --json` prints for the same options
    (the command's own steps for a search: the largest value found, and the estimate at the given
    batch or sequence, else at the largest found, at least 1; the layouts table, or the fewest GPUs)."""
    from pipeline.estimate import estimate, max_batch_size, max_seq_len
    from pipeline.estimate.memo import one_question

    if q.get("layouts") or q.get("min_gpus"):
        return layouts_answer(q)
    kwargs = {name: value for name, value in q.items() if name not in ("layouts", "min_gpus")}
    search_batch, search_seq = kwargs.pop("max_batch_size", False), kwargs.pop("max_seq_len", False)
    # a dataset's worst step is the answer's, at the value found (as the command adds it): not the search's
    lengths = kwargs.pop("lengths", None) if search_batch or search_seq else None
    with one_question():  # the answer at the value found repeats one of the search's simulations
        if search_batch:
            batch = kwargs.pop("batch", None)
            found = max_batch_size(**kwargs)
            result = estimate(**kwargs, batch=batch or max(found, 1), lengths=lengths)
            result["max_batch_size"] = found
        elif search_seq:
            seq = kwargs.pop("seq", None)
            found = max_seq_len(**kwargs)
            result = estimate(**kwargs, seq=seq or max(found, 1), lengths=lengths)
            result["max_seq_len"] = found
        else:
            result = estimate(**kwargs)
    return result


def layouts_answer(q: dict) -> dict:
    """`pipeline.estimate.layouts` of the question: the table for N = 1, 2, 4, ... up to num_gpus, or the fewest
    GPUs that fit (`min_gpus`); the layout fields are the table's to vary, as `--layouts` drops them."""
    *_, end = layouts_events_of(q)
    return end["answer"]


def layouts_events_of(q: dict):
    """`layouts_answer`'s question as it goes (`pipeline.estimate.api.layouts_stream`): its events."""
    from pipeline.estimate.api import layouts_stream

    kwargs = {name: value for name, value in q.items() if name not in (*LAYOUT_FIELDS, *SEARCHES)}
    return layouts_stream(**kwargs, min_gpus=bool(q.get("min_gpus")))


def to_json(result: dict) -> str:
    """The answer as `estimate --json` prints it (pipeline/estimate/cli.py: json.dumps, indent 2)."""
    return json.dumps(result, indent=2)
