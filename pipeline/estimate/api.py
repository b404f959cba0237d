"""The public functions: `estimate`, `max_batch_size`, `max_seq_len`, and `answer` (the JSON answer)."""

from __future__ import annotations

from pipeline.training.adapters import adapter_from_options
from pipeline.formulas.gpus import Device
from pipeline.estimate.estimators import ESTIMATORS, Estimator
from pipeline.estimate.search import largest_batch, largest_seq
from pipeline.core.errors import UserError
from pipeline.estimate.targets import resolve_target
from pipeline.estimate.training_args import read_training_args
from pipeline.training.hyperparameters import Hyperparameters
from pipeline.training.values import GIB, Run, Target
from pipeline.estimate.verdict import judge, limited, required_device, gpu_of
from pipeline.core.vocabulary import METHODS, ROLLOUT_CLIENTS, TRL_CLIENTS, check_choice, precision_mode
from pipeline.training.step import SFT_DEFAULT_CHECKPOINTING



def prepare(method, coefficients, model=None, config=None, params=None, active_params=None):
    """(estimator, target) for a method and what is estimated; one-line UserError for bad input."""
    check_choice("method", method, METHODS)
    target = resolve_target(model, config, params, method, active_params)
    return ESTIMATORS[method].load(coefficients), target


def make_run(batch=None, seq=None, precision=None, optimizer=None, checkpointing=None, attn_implementation=None,
             expandable_segments=False, client=None, optim=None, gradient_accumulation=None,
             training_args=None, num_gpus=None, sharding=None, adapter=None, liger_kernel=None, completion_share=None,
             sft_config=None, weights_dtype=None, declared_dtype=None, shard_group=None, tensor_parallel=None,
             accelerate_config=None, deepspeed=None, alloc_conf=None, rollout=None,
             grpo_config=None, axolotl_config=None, llamafactory_config=None, packing=None,
             padding_free=None) -> tuple[Run, list]:
    """The Run of the user's options, and notes. `training_args` (a TrainingArguments JSON path or dict)
    sets the trainer client and what it names, `sft_config` (TRL's SFT config, YAML or JSON) the sft
    client and what it names; an option given explicitly wins over a file's.

    Without `precision`, the autocast of the file (bf16 / fp16; SFTTrainer's default bf16 for the sft
    and dpo clients) and the dtype of the weights make it (`vocabulary.precision_of`): `weights_dtype` (bf16 |
    fp32), else the SFT config's dtype, else `declared_dtype()` (the model config's dtype / torch_dtype),
    else fp32 (with a note). The sft and dpo clients checkpoint unless told otherwise (TRL's default)."""
    from pipeline.core.vocabulary import WEIGHTS_DTYPES, precision_of

    given = {"batch": batch, "seq": seq, "precision": precision, "checkpointing": checkpointing, "client": client,
             "optim": optim, "gradient_accumulation": gradient_accumulation, "liger_kernel": liger_kernel,
             "adapter": adapter, "num_gpus": num_gpus, "sharding": sharding}
    notes, from_file = [], {}
    if sum(f is not None for f in (training_args, sft_config, grpo_config, axolotl_config, llamafactory_config)) > 1:
        raise UserError("give one training file: training arguments (--training-args), an SFT config (--sft-config), "
                        "a GRPO / RLOO config (--grpo-config), an Axolotl config (--axolotl-config) or a "
                        "LLaMA-Factory config (--llamafactory-config)")
    from_file = read_training_file(training_args, sft_config, grpo_config, axolotl_config, llamafactory_config,
                                   client)
    if accelerate_config is not None:
        from pipeline.estimate.launch import read_accelerate_config

        launch = read_accelerate_config(accelerate_config)
        notes += launch.pop("notes")
        if "autocast" in launch and "autocast" not in from_file:  # the training file's bf16 / fp16 wins
            from_file["autocast"] = launch.pop("autocast")
        from_file = {**launch, **{k: v for k, v in from_file.items() if k != "sharding" or "sharding" not in launch}}
    if alloc_conf is not None:
        from pipeline.training.alloc_conf import read_alloc_conf

        allocator = read_alloc_conf(alloc_conf)
        expandable_segments = expandable_segments or allocator["expandable_segments"]
        notes += allocator["notes"]
    deepspeed = deepspeed if deepspeed is not None else from_file.pop("deepspeed_source", None)
    from_file.pop("deepspeed_source", None)
    if deepspeed is not None:
        from_file = with_deepspeed(from_file, deepspeed, sharding)
    notes += from_file.pop("notes", [])
    given = {key: from_file.get(key) if value is None else value for key, value in given.items()}
    from pipeline.estimate.launch import check_crashing_sharding

    check_crashing_sharding(given["sharding"], given["client"] or "loop")
    if given["sharding"] is not None and given["num_gpus"] is None:
        raise UserError(f"sharding {given['sharding']} needs the number of GPUs: --num-gpus (num_gpus=), or an "
                        "accelerate config's num_processes")
    if weights_dtype is not None:
        check_choice("weights dtype", weights_dtype, WEIGHTS_DTYPES)
    client = given["client"] or "loop"
    trl = client in TRL_CLIENTS + ROLLOUT_CLIENTS
    if given["precision"] is None:
        autocast = from_file["autocast"] if "autocast" in from_file else "bf16" if trl else None
        if autocast is None and not from_file and not trl:
            raise UserError("the precision is required: --precision (precision=), or a training file's bf16 / fp16 "
                            "with the weights' dtype (--training-args, --sft-config)")
        weights = weights_dtype or from_file.get("weights") or (declared_dtype() if declared_dtype else None)
        if weights is None:
            weights = "fp32"
            notes.append("the weights' dtype is not known (the config names none): fp32 weights are assumed; a model "
                         "loaded in bf16 gives --weights-dtype bf16")
        given["precision"] = precision_of(weights, autocast)
    elif weights_dtype is not None and precision_mode(given["precision"]).weights != weights_dtype:
        raise UserError(f"precision {given['precision']} has {precision_mode(given['precision']).weights} weights, "
                        f"not the weights dtype {weights_dtype}")
    if given["batch"] is None:
        raise UserError("the batch size is required: --batch (batch=), or per_device_train_batch_size in the "
                        "training file (or --max-batch-size)")
    if given["seq"] is None and client in ROLLOUT_CLIENTS:
        from pipeline.training.rollout import DEFAULT_PROMPT_LENGTH

        given["seq"] = DEFAULT_PROMPT_LENGTH
        notes.append(f"prompts of {DEFAULT_PROMPT_LENGTH} tokens (no --seq): GRPOConfig's max_prompt_length had this "
                     "default until TRL removed it; give your dataset's longest prompt with --seq")
    if given["seq"] is None:
        raise UserError("the sequence length is required: --seq (seq=), or max_length in the SFT config")
    if given["checkpointing"] is None:
        given["checkpointing"] = trl and SFT_DEFAULT_CHECKPOINTING  # TRL's configs checkpoint
    if not isinstance(given["checkpointing"], bool):
        raise UserError(f"checkpointing must be true or false, not {given['checkpointing']!r}")
    attn_implementation = attn_implementation or from_file.get("attn_implementation")
    run = Run(given["batch"], given["seq"], given["precision"], optimizer, given["checkpointing"], attn_implementation,
              expandable_segments, client, given["optim"],
              1 if given["gradient_accumulation"] is None else given["gradient_accumulation"],
              1 if given["num_gpus"] is None else given["num_gpus"], given["sharding"], shard_group,
              1 if tensor_parallel is None else tensor_parallel, given["adapter"],
              liger_kernel=False if given["liger_kernel"] is None else given["liger_kernel"],
              completion_share=1.0 if completion_share is None else completion_share,
              deepspeed=from_file.get("deepspeed"),
              hyperparameters=from_file.get("hyperparameters") or Hyperparameters(),
              rollout=rollout_of(client, from_file.get("rollout"), rollout),
              packing=packing_of(client, from_file.get("packing"), packing, padding_free))
    return run, [*notes, *(given["adapter"].notes if given["adapter"] is not None else ())]


def vllm_notes(run: Run, target: Target, dev: Device | None) -> list:
    """What the answer says of vLLM's generation (modelled, not simulated); a colocated pool too small for vLLM's
    copy of the weights stops the run at its start (one line, before anything is simulated)."""
    from pipeline.estimate.verdict import vllm_pool_bytes
    from pipeline.simulate.crashes import RunWouldCrash

    mode = run.rollout.vllm_mode or "colocate"
    if mode == "server":
        return ["vLLM in server mode generates on GPUs of its own: the training GPUs hold no generation (the weight "
                "sync's NCCL communicator is not counted)"]
    if dev is None:
        return ["vLLM in colocate mode takes vllm_gpu_memory_utilization of the GPU beside the training step: give "
                "the GPU (--gpu) for the verdict to count it"]
    pool = vllm_pool_bytes(run, dev)
    weights = 2 * target.parameters  # each training process's engine holds the whole model (vLLM tensor parallel 1)
    if weights > pool:
        raise RunWouldCrash(f"vLLM (colocate) would not start: its bf16 copy of the weights ({weights / GIB:.1f} GiB) "
                            f"does not fit its share of the GPU ({pool / GIB:.1f} GiB, vllm_gpu_memory_utilization "
                            f"of {dev.total_bytes / GIB:.1f} GiB): raise vllm_gpu_memory_utilization, or use "
                            "vllm_mode server")
    return [f"vLLM (colocate) is modelled, not simulated: it keeps {pool / GIB:.1f} GiB of the GPU "
            "(vllm_gpu_memory_utilization of its total: its weights, activations and the KV cache it sizes to fill "
            "the rest) beside the training step, counted in the verdict as memory outside the step; its weight sync "
            "and sleep mode are not modelled"]


def read_training_file(training_args, sft_config, grpo_config, axolotl_config, llamafactory_config,
                       client) -> dict:
    """The settings of the one training file given (a path or its parsed dict), or {}."""
    if training_args is not None:
        return read_training_args(training_args)
    from pipeline.estimate.sft_config import read_sft_config

    if sft_config is not None:
        return read_sft_config(sft_config)
    if grpo_config is not None:
        if client not in (None, *ROLLOUT_CLIENTS):
            raise UserError(f"a GRPO / RLOO config (--grpo-config) runs the grpo or rloo client, not {client}")
        return read_sft_config(grpo_config, client or "grpo")
    from pipeline.estimate.frameworks import read_axolotl_config, read_llamafactory_config

    if axolotl_config is not None:
        return read_axolotl_config(axolotl_config)
    if llamafactory_config is not None:
        return read_llamafactory_config(llamafactory_config)
    return {}


def rollout_columns(run: Run) -> dict:
    """The rollout as the run has it (TRL's defaults filled in), and whether a reference model is held."""
    from dataclasses import asdict

    full = run.rollout.defaults(run.client)
    return {**asdict(full), "steps_per_generation": full.steps_per_generation or run.gradient_accumulation,
            "reference_model": full.beta > 0 and run.adapter is None}


def rollout_of(client: str, from_file: dict | None, given: dict | None):
    """The run's `Rollout` (grpo, rloo): the explicit keys over the file's; None for the other clients, which
    refuse rollout keys in one line."""
    from pipeline.training.rollout import Rollout

    keys = {**(from_file or {}), **{k: v for k, v in (given or {}).items() if v is not None}}
    if keys.get("use_vllm") is False and client not in ROLLOUT_CLIENTS:
        keys.pop("use_vllm")
    if client not in ROLLOUT_CLIENTS:
        if keys:
            raise UserError(f"{', '.join(sorted(keys))}: GRPO's and RLOO's settings (--client grpo or rloo), not the "
                            f"{client} client's")
        return None
    return Rollout.of(keys, f"{client} settings", client)


def packing_of(client: str, from_file, packing, padding_free):
    """The run's `Packing` (sft): the explicit `packing` / `padding_free` over the file's; None where neither is on."""
    from pipeline.training.packing import Packing

    if from_file is not None:  # TRL's bfd packing turns padding-free on whatever padding_free says
        packing = from_file.packing if packing is None else packing
        padding_free = from_file.padding_free if padding_free is None else padding_free
    given = Packing.of(packing, padding_free, "packing")
    if given is not None and client != "sft":
        raise UserError(f"packing and padding_free are TRL's SFTTrainer's (--client sft), not the {client} client's")
    return given


def with_deepspeed(from_file: dict, source, sharding) -> dict:
    """The settings of the files with a DeepSpeed config's (`training.zero.read_deepspeed`): its stage is the
    sharding (an explicit other one is refused), its batch, accumulation and bf16 / fp16 where it fixes them and
    the training file does not."""
    from pipeline.training.zero import read_deepspeed

    settings = read_deepspeed(source)
    if sharding is not None and sharding != settings["sharding"]:
        raise UserError(f"sharding {sharding} is not the DeepSpeed config's ({settings['sharding']}: its stage)")
    merged = {**from_file, "sharding": settings["sharding"], "deepspeed": settings["deepspeed"],
              "notes": [*from_file.get("notes", []), *settings["notes"]]}
    for key in ("batch", "gradient_accumulation", "autocast"):
        if key in settings and from_file.get(key) is None:
            merged[key] = settings[key]
    return merged


def model_of_file(model, config, params, options: dict) -> tuple:
    """(model, notes): the training file's model (an SFT / GRPO config's model_name_or_path, an Axolotl config's
    base_model, a LLaMA-Factory config's model_name_or_path) when no model, config or parameter count is given."""
    files = {k: options.get(k) for k in ("sft_config", "grpo_config", "axolotl_config", "llamafactory_config")}
    given = {k: v for k, v in files.items() if v is not None}
    if len(given) != 1 or any(x is not None for x in (model, config, params)):
        return model, []
    (kind, source), = given.items()
    named = read_training_file(None, files["sft_config"], files["grpo_config"], files["axolotl_config"],
                               files["llamafactory_config"], options.get("client"))["model"]
    key = "base_model" if kind == "axolotl_config" else "model_name_or_path"
    if named is None:
        raise UserError(f"{kind.replace('_', ' ')}: no {key} (the file names no model; give --model)")
    return named, [f"{kind.replace('_', ' ')}: the model is its {key}, {named}"]


RUN_OPTIONS = ("alloc_conf", "batch", "seq", "precision", "optimizer", "checkpointing", "attn_implementation",
               "expandable_segments",
               "client", "optim", "gradient_accumulation", "training_args", "num_gpus", "sharding", "liger_kernel",
               "completion_share", "sft_config", "weights_dtype", "shard_group", "tensor_parallel", "accelerate_config",
               "deepspeed", "rollout", "grpo_config", "axolotl_config", "llamafactory_config", "packing", "padding_free")
ROLLOUT_OPTIONS = ("num_generations", "max_completion_length", "beta", "use_vllm", "vllm_mode",
                   "vllm_gpu_memory_utilization")


def prepared(what: dict, options: dict, method, coefficients, dev: Device | None) -> tuple:
    """(estimator, target, run limited to `dev`, notes) of the public functions and the command: `what`
    holds model, config, params, active_params (an SFT config's model_name_or_path fills a missing
    model); `options` make_run's options plus the adapter's (lora_r, lora_alpha, lora_targets,
    quantization, peft_config, lora_dropout)."""
    from pipeline.estimate.targets import declared_weights_dtype

    what = dict(what)
    what["model"], notes = model_of_file(what["model"], what["config"], what["params"], options)
    adapter = adapter_from_options(*(options.get(k) for k in ("lora_r", "lora_alpha", "lora_targets", "quantization",
                                                              "peft_config", "lora_dropout")))
    options = {**options, "rollout": {k: options[k] for k in ROLLOUT_OPTIONS if options.get(k) is not None}}
    run, file_notes = make_run(**{k: options[k] for k in RUN_OPTIONS if k in options}, adapter=adapter,
                               declared_dtype=lambda: declared_weights_dtype(what["model"], what["config"]))
    method = default_method(run) if method is None else method
    check_choice("method", method, METHODS)
    estimator, target = prepare(method, coefficients, what["model"], what["config"], what["params"],
                                what["active_params"])
    if run.rollout is not None and run.rollout.use_vllm:  # a colocated vLLM that cannot start: before any search
        vllm_notes(run, target, dev)
    return estimator, target, limited(run, dev), [*notes, *file_notes]


def default_method(run: Run) -> str:
    """The method of a question that names none: exact for DeepSpeed's ZeRO (it runs DeepSpeed's code; the
    closed forms refuse it), DPO and the online RL clients (which the closed forms refuse too), packed batches
    (whose attention mask the closed forms do not know), eager attention and adapters (the heuristic's line is full
    fine-tuning's with SDPA: on the measured LoRA / QLoRA points its median error is 26% / 64%), else the
    heuristic."""
    from pipeline.estimate.estimators import EXACT_ONLY_CLIENTS

    return "exact" if run.deepspeed is not None or run.client in EXACT_ONLY_CLIENTS or run.packing is not None \
        or run.attn_implementation == "eager" or run.adapter is not None else "heuristic"


def estimate(model=None, config=None, params=None, *, batch=None, seq=None, precision=None, optimizer=None,
             checkpointing=None, method=None, coefficients=None, gpu=None, gpu_memory_gib=None,
             attn_implementation=None, active_params=None, expandable_segments=False, client=None, optim=None,
             gradient_accumulation=None, training_args=None, num_gpus=None, sharding=None, lora_r=None,
             lora_alpha=None, lora_targets=None, lora_dropout=None, quantization=None, peft_config=None, liger_kernel=None,
             completion_share=None, sft_config=None, weights_dtype=None, shard_group=None, tensor_parallel=None,
             accelerate_config=None, deepspeed=None, alloc_conf=None, num_generations=None,
             max_completion_length=None, beta=None, use_vllm=None, vllm_mode=None, vllm_gpu_memory_utilization=None,
             grpo_config=None, axolotl_config=None, llamafactory_config=None, packing=None, padding_free=None,
             lengths=None, dataset=None, tokenizer=None) -> dict:
    """Peak memory of a training step at (batch, seq), with its components (bytes).

    Give one of `model` (registry or Hub id), `config` (config.json path, its dict, or a
    transformers config) or `params` (N; blog and heuristic only; with `active_params` for a MoE
    model, else it counts as dense). `coefficients` is a path or a loaded coefficient dict (default:
    results/coefficients.json). With `gpu` (a catalogue name, `pipeline.formulas.gpus.DEVICES`) or
    `gpu_memory_gib` (nvidia-smi's total in GiB) the answer says whether it fits ("fits",
    "headroom_bytes"), judged on the reserved bytes plus the memory outside PyTorch;
    `expandable_segments` replays PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, `alloc_conf` that variable's
    text (`training.alloc_conf`: expandable_segments replayed, garbage_collection_threshold noted, the rest refused).

    The step is the standard loop's (`client="loop"`, `optimizer` adamw or sgd), transformers.Trainer's
    (`client="trainer"`, `optim` by its TrainingArguments name, default adamw_torch_fused,
    `gradient_accumulation` micro-batches per step) or TRL's SFTTrainer's (`client="sft"`: checkpointing on
    unless `checkpointing=False`, `completion_share` the share of positions with a label) or DPOTrainer's
    (`client="dpo"`, exact method only: `batch` preference pairs, 2B sequences of `seq` tokens, a reference
    copy of the model, or with LoRA the base with its adapters disabled; TRL's defaults as for sft);
    `liger_kernel` runs Liger's kernels (trainer, sft, dpo). `training_args` (a TrainingArguments JSON path or
    dict) sets the trainer and what it names, `sft_config` (TRL's SFT config, YAML or JSON, as `trl sft --config`
    takes it) the sft client and what it names (its model_name_or_path too). Without `precision`, a file's bf16 /
    fp16 (SFTTrainer's default bf16) and the weights' dtype make it: `weights_dtype` (bf16 | fp32), else the SFT
    config's dtype, else the model config's dtype / torch_dtype.

    LoRA: `lora_r` (rank), `lora_alpha` (default 2r), `lora_targets` ("all-linear" or module names
    joined by commas), `lora_dropout` (PEFT's dropout on each adapter's input, default 0), `quantization` (nf4 |
    int8: QLoRA), or `peft_config` (an adapter_config.json).

    Several GPUs: `num_gpus` N and `sharding` ddp | fsdp | fsdp-no-reshard (FSDP2 per decoder layer
    and the root) | hsdp (FSDP2 over `shard_group` S GPUs, replicated across N / S), `tensor_parallel` T (the
    model's tensor-parallel plan over T GPUs; the sharding over the N / T data-parallel ranks), or
    `accelerate_config` (an accelerate config file: num_processes, distributed_type, mixed_precision, fsdp_config);
    the Trainer clients take the FSDP keys of their training files too. `batch` is per data-parallel rank; the
    answer is one GPU's (every rank holds the same), its fit verdict per GPU with NCCL's memory outside PyTorch.
    DeepSpeed's ZeRO as the Trainer clients run it: `sharding` zero1 | zero2 | zero3 (its defaults), or
    `deepspeed` (a DeepSpeed config JSON path or dict, as `--deepspeed ds_config.json` gives the Trainer; its stage
    is the sharding; the `deepspeed` key of a training file or an accelerate config's deepspeed_config likewise),
    answered by the exact method, which runs DeepSpeed's code.

    Online RL (exact method only): TRL's GRPOTrainer (`client="grpo"`) and RLOOTrainer (`client="rloo"`), with
    generation by transformers' `generate` in the step: `batch` completions per micro-batch (TRL's
    per_device_train_batch_size), `seq` the prompt's length in tokens, `num_generations` completions per prompt,
    `max_completion_length` tokens each (every completion runs to it: the worst case), `beta` > 0 a reference
    model; `grpo_config` a GRPOConfig / RLOOConfig file (YAML or JSON) as `sft_config`. The answer's
    `peak_phase` says where the peak falls: generation, log-probs, forward, backward or optimizer.

    Frameworks' files: `axolotl_config` (an Axolotl YAML) and `llamafactory_config` (a LLaMA-Factory training
    YAML), a path or the parsed dict: the run they launch (their Trainer, or TRL's for dpo / grpo stages; model,
    batch, length, precision, checkpointing, LoRA / QLoRA, Liger, DeepSpeed, FSDP); a key that changes memory in a
    way not simulated yet is refused in one line naming it. Explicit options win.

    Packed batches (sft, exact by default): `packing` (TRL's best fit decreasing into rows of `seq` tokens, which
    turns `padding_free` on) and `padding_free` (a micro-batch's rows concatenated into one, position ids restarting
    at each document, no attention mask: torch's SDPA then gets a (N, N) packed-sequence mask); every row full, the
    worst case. `lengths` (a dataset's token counts per document) adds `worst_step`: the micro-batch of that
    dataset with the most tokens (the fullest packed rows, or the longest documents) and its peak and verdict;
    `dataset` (a local JSON / JSONL file or a Hub dataset id) gives them, tokenized as SFTTrainer does with the model's
    tokenizer (`tokenizer`: another, or a folder).

    `method`: blog, heuristic, formula or exact; None: heuristic, or exact for DeepSpeed and the online RL
    clients (the closed forms model neither).
    """
    options = dict(locals())
    dev = gpu_of(gpu, gpu_memory_gib)
    estimator, target, run, notes = prepared(_what(options), options, method, coefficients, dev)
    lengths = lengths_of(lengths, dataset, tokenizer, target)
    result = with_notes(answer(estimator, target, run, dev), notes)
    return result if lengths is None else with_worst_step(result, estimator, target, run, dev, lengths)


def lengths_of(lengths, dataset, tokenizer, target: Target):
    """The documents' token counts of the worst step: `lengths`, or those of `dataset` tokenized with `tokenizer` (by
    default the model's); None for neither."""
    if dataset is None:
        if tokenizer is not None:
            raise UserError("tokenizer goes with a dataset (--dataset)")
        if lengths is None:
            return None
        from pipeline.training.packing import check_lengths

        return check_lengths(lengths)  # before anything is simulated
    if lengths is not None:
        raise UserError("give a dataset or its lengths, not both")
    if tokenizer is None and target.model_id is None:
        raise UserError("dataset: its tokenizer is the model's, and no model id is given: give --tokenizer")
    from pipeline.training.dataset_lengths import dataset_lengths

    return dataset_lengths(dataset, tokenizer or target.model_id)


def with_worst_step(result: dict, estimator: Estimator, target: Target, run: Run, dev: Device | None,
                    lengths) -> dict:
    """The answer with `worst_step`: the micro-batch with the most tokens of a dataset of documents of `lengths`
    tokens (`training.packing.worst_step`), its peak and, for a device, its verdict."""
    from dataclasses import replace

    from pipeline.training.packing import worst_step

    worst = worst_step(lengths, run.batch, run.seq, run.packing)
    step = replace(run, batch=worst.batch, seq=worst.seq, packing=worst.packing)  # its rows, their length
    at = answer(estimator, target, step, dev)
    result["worst_step"] = {"tokens": worst.tokens, "seq_len": step.seq, "documents": len(lengths),
                            **{k: at[k] for k in ("peak_bytes", "peak_reserved_bytes", "fits", "headroom_bytes")
                               if k in at}}
    result.setdefault("notes", []).append(worst.note(run.batch, run.seq, len(lengths)))
    return result



def _what(options: dict) -> dict:
    return {k: options.get(k) for k in ("model", "config", "params", "active_params")}


def with_notes(result: dict, notes: list) -> dict:
    if notes:
        result["notes"] = [*result.get("notes", []), *notes]
    return result


def answer(estimator: Estimator, target: Target, run: Run, dev: Device | None = None) -> dict:
    """The estimate as the JSON answer: what was estimated, the method's details, components, peak,
    reserved bytes and, for a device, the fit verdict."""
    vllm = vllm_notes(run, target, dev) if run.rollout is not None and run.rollout.use_vllm else []
    estimated = estimator.predict(target, run)
    peak = estimated.peak_bytes
    result = {"method": estimator.name, "model_id": target.model_id, "parameters": target.parameters,
              "active_parameters": target.active, "parameters_source": target.source,
              "batch_size": run.batch, "seq_len": run.seq, "precision": run.precision, "client": run.client,
              "optimizer": run.optimizer, "optim": run.optim, "gradient_accumulation": run.gradient_accumulation,
              **run.layout.columns(),
              "adapter": None if run.adapter is None else run.adapter.columns(),
              "liger_kernel": run.liger_kernel, "completion_share": run.completion_share,
              **({"rollout": rollout_columns(run)} if run.rollout is not None else {}),
              **({"packing": run.packing.packing, "padding_free": run.packing.padding_free}
                 if run.packing is not None else {}),
              "checkpointing": run.checkpointing, "expandable_segments": run.expandable_segments,
              **estimated.details, "components": estimated.components, "peak_formula": estimator.peak_formula,
              "peak_bytes": peak, "peak_gib": peak / GIB,
              "peak_reserved_bytes": estimated.reserved(run.expandable_segments)}
    if vllm:
        result.setdefault("notes", []).extend(vllm)
        if dev is not None:
            from pipeline.estimate.verdict import vllm_pool_bytes

            result["vllm_pool_bytes"] = vllm_pool_bytes(run, dev) or None
    if dev is not None:
        verdict = judge(estimated, run, dev)
        result.update(gpu=dev.name, device_total_bytes=dev.total_bytes, gpu_memory_bytes=dev.total_bytes,
                      outside_bytes=verdict.outside_bytes, fits=bool(verdict.fits),
                      headroom_bytes=verdict.headroom_bytes)
        if not run.expandable_segments:
            result["expandable_segments_would_fit"] = bool(verdict.expandable_fits)
            if verdict.expandable_fits and not verdict.fits:
                result.setdefault("notes", []).append(
                    "does not fit with the allocator's default settings, but fits with "
                    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (no segment fragmentation)")
    return result


def max_batch_size(model=None, config=None, params=None, *, seq=None, precision=None, gpu=None, gpu_memory_gib=None,
                   optimizer=None, checkpointing=None, method=None, coefficients=None,
                   attn_implementation=None, active_params=None, expandable_segments=False, client=None, optim=None,
                   gradient_accumulation=None, training_args=None, num_gpus=None, sharding=None, lora_r=None,
                   lora_alpha=None, lora_targets=None, lora_dropout=None, quantization=None, peft_config=None, liger_kernel=None,
                   completion_share=None, sft_config=None, weights_dtype=None, shard_group=None, tensor_parallel=None,
                   accelerate_config=None, deepspeed=None, alloc_conf=None, num_generations=None,
                   max_completion_length=None, beta=None, use_vllm=None, vllm_mode=None,
                   vllm_gpu_memory_utilization=None, grpo_config=None, axolotl_config=None,
                   llamafactory_config=None, packing=None, padding_free=None) -> int:
    """The largest batch that fits the GPU at sequence length `seq` (0: none), by the fit verdict;
    the options are `estimate`'s."""
    options = dict(locals(), batch=1)
    dev = required_device(gpu, gpu_memory_gib)
    estimator, target, run, _ = prepared(_what(options), options, method, coefficients, dev)
    return largest_batch(estimator, target, run, dev)


def max_seq_len(model=None, config=None, params=None, *, batch=None, precision=None, gpu=None, gpu_memory_gib=None,
                optimizer=None, checkpointing=None, method=None, coefficients=None,
                attn_implementation=None, active_params=None, expandable_segments=False, client=None, optim=None,
                gradient_accumulation=None, training_args=None, num_gpus=None, sharding=None, lora_r=None,
                lora_alpha=None, lora_targets=None, lora_dropout=None, quantization=None, peft_config=None, liger_kernel=None,
                completion_share=None, sft_config=None, weights_dtype=None, shard_group=None, tensor_parallel=None,
                accelerate_config=None, deepspeed=None, alloc_conf=None, num_generations=None,
                max_completion_length=None, beta=None, use_vllm=None, vllm_mode=None,
                vllm_gpu_memory_utilization=None, grpo_config=None, axolotl_config=None,
                llamafactory_config=None, packing=None, padding_free=None) -> int:
    """The longest sequence that fits the GPU at batch size `batch` (0: none), by the fit verdict,
    at most the model's context length when its config gives one; the options are `estimate`'s."""
    options = dict(locals(), seq=1)
    dev = required_device(gpu, gpu_memory_gib)
    estimator, target, run, _ = prepared(_what(options), options, method, coefficients, dev)
    return largest_seq(estimator, target, run, dev)


def layouts_answer(estimator, target, run, dev, fewest: bool, num_gpus: int | None) -> dict:
    """The layouts table (N = 1, 2, 4, ... up to `num_gpus`, default 8) or the fewest GPUs that fit, as JSON."""
    *_, end = layouts_events(estimator, target, run, dev, fewest, num_gpus)
    return end["answer"]


def layouts_events(estimator, target, run, dev, fewest: bool, num_gpus: int | None):
    """`layouts_answer` as it is made: {"event": "start", "layouts": the table's rows to come (None for the fewest
    GPUs, which asks N after N)}, the search's events as each layout is answered ({"event": "row", "index",
    "row"}; the fewest GPUs' {"event": "count", "num_gpus", "layouts"} before each N), then {"event": "end",
    "answer": the answer}."""
    from pipeline.core.vocabulary import MAX_GPUS
    from pipeline.estimate.layout_search import doubling, fewest_gpus_events, layout_rows, planned_layouts

    base = {"method": estimator.name, "model_id": target.model_id, "parameters": target.parameters,
            "batch_size": run.batch, "seq_len": run.seq, "precision": run.precision, "client": run.client,
            "checkpointing": run.checkpointing, "gpu": dev.name, "device_total_bytes": dev.total_bytes}
    rows = []
    if fewest:
        yield {"event": "start", "layouts": None}
        found = 0
        for event in fewest_gpus_events(estimator, target, run, dev, num_gpus or MAX_GPUS):
            if event["event"] == "found":
                found = event["min_gpus"]
                continue
            if event["event"] == "count":
                rows += [None] * event["layouts"]
            else:
                rows[event["index"]] = event["row"]
            yield event
        fitting = [r for r in rows if r["fits"] and r["num_gpus"] == found]
        best = max(fitting, key=lambda r: r["headroom_bytes"]) if fitting else None
        yield {"event": "end", "answer": {**base, "min_gpus": found, "layout": best, "layouts": rows}}
        return
    counts = doubling(num_gpus or 8)
    rows = [None] * len(planned_layouts(target, run, counts))
    yield {"event": "start", "layouts": len(rows)}
    for index, row in layout_rows(estimator, target, run, dev, counts):
        rows[index] = row
        yield {"event": "row", "index": index, "row": row}
    yield {"event": "end", "answer": {**base, "layouts": rows}}


def layouts(model=None, config=None, params=None, *, batch=None, seq=None, precision=None, optimizer=None,
            checkpointing=None, method=None, coefficients=None, gpu=None, gpu_memory_gib=None,
            attn_implementation=None, active_params=None, expandable_segments=False, client=None, optim=None,
            gradient_accumulation=None, training_args=None, num_gpus=None, lora_r=None, lora_alpha=None,
            lora_targets=None, lora_dropout=None, quantization=None, peft_config=None, liger_kernel=None, completion_share=None,
            sft_config=None, weights_dtype=None, accelerate_config=None, min_gpus=False, deepspeed=None,
            alloc_conf=None, num_generations=None, max_completion_length=None, beta=None, use_vllm=None,
            vllm_mode=None, vllm_gpu_memory_utilization=None, grpo_config=None, axolotl_config=None,
            llamafactory_config=None, packing=None, padding_free=None) -> dict:
    """The layouts that fit a GPU: a table of layouts (ddp, fsdp, fsdp-no-reshard; the loop also hsdp across nodes
    and tensor parallelism within one) for N = 1, 2, 4, ... up to `num_gpus` (default 8), each with its per-GPU
    peak, reserved bytes and verdict; with `min_gpus` the fewest GPUs that fit (doubling up to `num_gpus`, default
    4096) and the best layout there. The other options are `estimate`'s (an `accelerate_config` gives its mixed
    precision and what it says of the clients); the layout is the table's to vary."""
    *_, end = layouts_stream(**locals())
    return end["answer"]


def layouts_stream(**options):
    """`layouts` as it goes (its keyword arguments): the events of `layouts_events`, the last one's answer with the
    question's notes. Bad options raise at the first event."""
    num_gpus, min_gpus = options.get("num_gpus"), bool(options.pop("min_gpus", False))
    options["num_gpus"] = None
    if options.get("deepspeed") is not None:
        raise UserError("the layouts table compares ddp and FSDP2 layouts; ask a DeepSpeed config with num_gpus")
    dev = required_device(options.get("gpu"), options.get("gpu_memory_gib"))
    estimator, target, run, notes = prepared(_what(options), options, options.get("method"),
                                             options.get("coefficients"), dev)
    for event in layouts_events(estimator, target, run, dev, min_gpus, num_gpus):
        yield {**event, "answer": with_notes(event["answer"], notes)} if event["event"] == "end" else event
