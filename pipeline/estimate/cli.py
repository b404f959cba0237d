"""`python -m pipeline estimate`: the peak of a step, or the largest batch or sequence that fits a GPU."""

from __future__ import annotations

import argparse
import json

from pipeline.formulas.gpus import DEVICES
from pipeline.core.errors import UserError
from pipeline.estimate.api import answer, layouts_answer, lengths_of, prepared, with_notes, with_worst_step
from pipeline.estimate.memo import one_question
from pipeline.estimate.search import largest_batch, largest_seq
from pipeline.training.values import GIB
from pipeline.estimate.verdict import gpu_of
from pipeline.core.vocabulary import (CLIENTS, CRASHING_SHARDINGS, METHODS, OPTIMIZERS, OPTIMS, PRECISIONS, ROLLOUT_CLIENTS, SHARDINGS,
                                      WEIGHTS_DTYPES)


def add_cli(subparsers) -> None:
    from pipeline.training.adapters import add_adapter_arguments
    from pipeline.core.arguments import positive_int, positive_number
    from pipeline.core.paths import COEFFICIENTS

    parser = subparsers.add_parser("estimate", help="estimate the peak memory of a training step")
    source = parser.add_mutually_exclusive_group()  # one of them, or an --sft-config's model_name_or_path
    source.add_argument("--model", help="registry or Hugging Face model id")
    source.add_argument("--config", help="path of a Hugging Face config.json")
    source.add_argument("--params", help="parameter count N (blog and heuristic only)")
    parser.add_argument("--active-params", help="with --params: parameters active per token (MoE; default N)")
    parser.add_argument("--batch", type=positive_int, help="batch size B (optional with --max-batch-size)")
    parser.add_argument("--seq", type=positive_int, help="sequence length L (optional with --max-seq-len; "
                        "grpo / rloo: the prompt's, default 512)")
    parser.add_argument("--precision", choices=PRECISIONS, default=None,
                        help="required unless a training file (--training-args, --sft-config) or --client sft/dpo sets "
                             "bf16 / fp16: then the weights' dtype decides")
    parser.add_argument("--weights-dtype", choices=WEIGHTS_DTYPES, default=None,
                        help="the dtype the model is loaded in (default: the config's dtype / torch_dtype); with bf16 "
                             "autocast, bf16 weights are bf16-autocast and fp32 weights amp-bf16")
    parser.add_argument("--client", choices=CLIENTS, default=None,
                        help="loop: the standard step (default); trainer: transformers.Trainer; sft, dpo: TRL's "
                             "SFTTrainer, DPOTrainer (checkpointing on unless --no-checkpointing; dpo: --batch "
                             "preference pairs, --method exact)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default=None, help="the loop's (default adamw)")
    parser.add_argument("--optim", choices=OPTIMS, default=None,
                        help="the trainer's, by its TrainingArguments name (default adamw_torch_fused)")
    parser.add_argument("--gradient-accumulation", type=positive_int, default=None, metavar="K",
                        help="micro-batches per optimizer step (trainer)")
    parser.add_argument("--training-args", default=None, metavar="FILE",
                        help="a TrainingArguments JSON (to_json_string()): the trainer client with its batch, "
                             "accumulation, bf16/fp16, checkpointing and optim; explicit options win")
    parser.add_argument("--sft-config", default=None, metavar="FILE",
                        help="TRL's SFT config (YAML or JSON, as `trl sft --config` takes it): the sft client with its "
                             "batch, max_length, accumulation, bf16/fp16, dtype, checkpointing, optim, LoRA/QLoRA, Liger "
                             "and model_name_or_path; explicit options win")
    parser.add_argument("--axolotl-config", default=None, metavar="FILE",
                        help="an Axolotl config (YAML, as `axolotl train` takes it): its model, micro batch, "
                             "sequence_len, adapter, precision, checkpointing, optimizer, DeepSpeed / FSDP and rl stage; "
                             "explicit options win")
    parser.add_argument("--llamafactory-config", default=None, metavar="FILE",
                        help="a LLaMA-Factory training config (YAML, as `llamafactory-cli train` takes it): its model, "
                             "stage, batch, cutoff_len, finetuning type, quantization, precision, DeepSpeed; explicit "
                             "options win")
    parser.add_argument("--checkpointing", action=argparse.BooleanOptionalAction, default=None,
                        help="gradient checkpointing (the sft client's default: on)")
    parser.add_argument("--liger-kernel", action="store_true", default=None,
                        help="Liger's kernels (use_liger_kernel=True; trainer, sft)")
    parser.add_argument("--completion-share", type=share, default=None, metavar="S",
                        help="the share of positions that carry a label, in (0, 1] (sft: completion_only_loss on "
                             "prompt-completion data; default 1)")
    add_adapter_arguments(parser)
    add_rollout_arguments(parser)
    add_packing_arguments(parser)
    parser.add_argument("--num-gpus", type=positive_int, default=None, metavar="N",
                        help="GPUs of the run (with --sharding; --batch is per data-parallel rank)")
    parser.add_argument("--sharding", choices=SHARDINGS + CRASHING_SHARDINGS, default=None,
                        help="ddp, or FSDP2 per decoder layer and the root (fsdp: resharded after forward), or hsdp "
                             "(FSDP2 over --shard-group GPUs, replicated across the rest), or DeepSpeed's ZeRO stage "
                             "as the Trainer clients run it (zero1, zero2, zero3; or --deepspeed FILE); fsdp-offload "
                             "(FSDP2's CPU offload) answers where its run crashes")
    parser.add_argument("--shard-group", type=positive_int, default=None, metavar="S",
                        help="hsdp: the GPUs one copy of the model is sharded over (usually a node's 8)")
    parser.add_argument("--tensor-parallel", type=positive_int, default=None, metavar="T",
                        help="tensor parallelism over T GPUs (the model's own plan); the sharding runs over N / T")
    parser.add_argument("--accelerate-config", default=None, metavar="FILE",
                        help="an accelerate config file (accelerate launch --config_file): num_processes, "
                             "distributed_type (MULTI_GPU: ddp; FSDP), mixed_precision, fsdp_config")
    layouts = parser.add_mutually_exclusive_group()
    layouts.add_argument("--layouts", action="store_true",
                         help="a table of layouts (ddp, fsdp, fsdp-no-reshard; the loop: hsdp, tensor parallel) for "
                              "N = 1, 2, 4, ... up to --num-gpus (default 8), each per-GPU peak and verdict (--gpu)")
    layouts.add_argument("--min-gpus", action="store_true",
                         help="the fewest GPUs (1, 2, 4, ...) with a layout that fits --gpu, and the layouts tried")
    parser.add_argument("--deepspeed", default=None, metavar="FILE",
                        help="a DeepSpeed config (as the Trainer's --deepspeed takes it): its ZeRO stage is the "
                             "sharding (zero1, zero2, zero3), with --num-gpus; answered by the exact method")
    parser.add_argument("--method", choices=METHODS, default=None,
                        help="default: heuristic, or exact for DeepSpeed (--deepspeed, --sharding zero1-3), dpo, "
                             "grpo, rloo, packed batches, eager attention and LoRA / QLoRA")
    parser.add_argument("--coefficients", default=None, help=f"coefficient file (default {COEFFICIENTS})")
    gpu = parser.add_mutually_exclusive_group()
    gpu.add_argument("--gpu", default=None, metavar="NAME", help=f"the GPU, one of: {', '.join(DEVICES)}")
    gpu.add_argument("--gpu-memory", type=positive_number, default=None, metavar="GIB",
                     help="the GPU's memory in GiB as nvidia-smi reports it (an 80 GB H100: 79.6)")
    parser.add_argument("--expandable-segments", action="store_true",
                        help="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    parser.add_argument("--alloc-conf", default=None, metavar="TEXT",
                        help="the run's PYTORCH_CUDA_ALLOC_CONF (expandable_segments is replayed)")
    search = parser.add_mutually_exclusive_group()
    search.add_argument("--max-batch-size", action="store_true", help="the largest B that fits the GPU")
    search.add_argument("--max-seq-len", action="store_true", help="the largest L that fits the GPU")
    parser.add_argument("--attn-implementation", default=None, help="for --method exact")
    parser.add_argument("--json", action="store_true", help="print the answer as JSON")
    parser.set_defaults(handler=_estimate_command)


def add_rollout_arguments(parser) -> None:
    """GRPO's and RLOO's options (--client grpo | rloo), by their GRPOConfig names."""
    from pipeline.core.arguments import positive_int

    group = parser.add_argument_group("online RL (--client grpo | rloo; exact method)")
    group.add_argument("--num-generations", type=positive_int, default=None, metavar="G",
                       help="completions per prompt (TRL's default: grpo 8, rloo 2)")
    group.add_argument("--max-completion-length", type=positive_int, default=None, metavar="C",
                       help="tokens per completion (default 512); --seq is the prompt's length")
    group.add_argument("--beta", type=float, default=None,
                       help="the KL coefficient: above 0 a reference model (default: grpo 0.0, rloo 0.05)")
    group.add_argument("--use-vllm", action="store_true", default=None,
                       help="generation by vLLM (modelled: its completions arrive from outside the training step)")
    group.add_argument("--vllm-mode", choices=("colocate", "server"), default=None,
                       help="colocate (default): vLLM keeps --vllm-gpu-memory-utilization of the GPU beside the step; "
                            "server: GPUs of its own")
    group.add_argument("--vllm-gpu-memory-utilization", type=float, default=None, metavar="U",
                       help="vLLM's share of the GPU in colocate mode (TRL's default 0.3)")
    group.add_argument("--grpo-config", default=None, metavar="FILE",
                       help="a GRPOConfig / RLOOConfig file (YAML or JSON, as `trl grpo --config`): batch, "
                            "accumulation, bf16/fp16, checkpointing, optim, LoRA and the rollout keys")


def add_packing_arguments(parser) -> None:
    """Packed and padding-free batches (--client sft), by their SFTConfig names."""
    group = parser.add_argument_group("packed batches (--client sft; exact method by default)")
    group.add_argument("--packing", action="store_true", default=None,
                       help="TRL's packing: documents packed into rows of --seq tokens (best fit decreasing), "
                            "padding-free; every row full")
    group.add_argument("--padding-free", action="store_true", default=None,
                       help="a micro-batch's documents concatenated into one row, no padding and no attention mask")
    group.add_argument("--lengths", default=None, metavar="FILE",
                       help="your dataset's document lengths (a JSON list, one count per line, or JSON lines with "
                            "input_ids): the answer adds its worst step, the micro-batch with the most tokens")
    group.add_argument("--dataset", default=None, metavar="FILE_OR_ID",
                       help="your dataset (a JSON / JSONL file with text, messages or prompt and completion, or a Hub "
                            "dataset id), tokenized as SFTTrainer does: its worst step, as --lengths")
    group.add_argument("--tokenizer", default=None, metavar="ID_OR_DIR",
                       help="with --dataset: the tokenizer (default: the model's)")


def share(text: str) -> float:
    """--completion-share: a number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number in (0, 1]") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number in (0, 1]")
    return value


def _estimate_command(args) -> int:
    if (args.layouts or args.min_gpus) and (args.max_batch_size or args.max_seq_len):
        raise UserError("ask for one of --layouts / --min-gpus and --max-batch-size / --max-seq-len, not both")
    searching = "--max-batch-size" if args.max_batch_size else "--max-seq-len" if args.max_seq_len else \
        "--min-gpus" if args.min_gpus else "--layouts" if args.layouts else None
    if searching and args.gpu is None and args.gpu_memory is None:
        raise UserError(f"{searching} needs --gpu NAME or --gpu-memory GIB")
    if args.grpo_config is not None and args.client is None:
        args.client = "grpo"
    files = [args.sft_config, args.axolotl_config, args.llamafactory_config]
    prompts_default = args.client in ROLLOUT_CLIENTS  # prompts of DEFAULT_PROMPT_LENGTH tokens, said in a note
    if args.seq is None and not args.max_seq_len and all(f is None for f in files) and not prompts_default:
        raise UserError("--seq L is required (unless --max-seq-len, or a training file with its length: --sft-config, "
                        "--axolotl-config, --llamafactory-config)")
    if args.model is None and args.config is None and args.params is None and all(
            f is None for f in [*files, args.grpo_config]):
        raise UserError("give one of --model, --config and --params (or a training file naming its model)")
    if (args.layouts or args.min_gpus) and (args.lengths or args.dataset):
        raise UserError("--lengths / --dataset answer a worst step, not with --layouts or --min-gpus: ask without them")
    lengths = None
    if args.lengths is not None:
        from pipeline.training.packing import read_lengths

        lengths = read_lengths(args.lengths)
    options = dict(vars(args), batch=1 if args.max_batch_size and args.batch is None else args.batch,
                   seq=1 if args.max_seq_len and args.seq is None else args.seq, gpu_memory_gib=args.gpu_memory)
    if args.layouts or args.min_gpus:  # the layouts are the answer's: the question is the run on one GPU
        if args.deepspeed is not None:
            raise UserError("the layouts table compares ddp and FSDP2 layouts; ask a DeepSpeed config with --num-gpus")
        options.update(num_gpus=None, sharding=None, shard_group=None, tensor_parallel=None)
    dev = gpu_of(args.gpu, args.gpu_memory)
    if args.method != "formula" and args.params is None:  # the model is built: transformers is imported
        without_unused_libraries_in_transformers()
    estimator, target, run, notes = prepared({k: options[k] for k in ("model", "config", "params", "active_params")},
                                             options, args.method, args.coefficients, dev)
    lengths = lengths_of(lengths, args.dataset, args.tokenizer, target)
    if args.layouts or args.min_gpus:
        result = layouts_answer(estimator, target, run, dev, args.min_gpus, args.num_gpus)
        print(json.dumps(result, indent=2) if args.json else layouts_summary(result))
        return 0
    with one_question():  # the answer at the value found repeats one of the search's simulations
        if args.max_batch_size:
            largest_found = largest_batch(estimator, target, run, dev)
            run = run.with_batch(args.batch or max(largest_found, 1))
        elif args.max_seq_len:
            largest_found = largest_seq(estimator, target, run, dev)
            run = run.with_seq(args.seq or max(largest_found, 1))
        result = with_notes(answer(estimator, target, run, dev), notes)
        if lengths is not None:
            result = with_worst_step(result, estimator, target, run, dev, lengths)
    if args.max_batch_size:
        result["max_batch_size"] = largest_found
    elif args.max_seq_len:
        result["max_seq_len"] = largest_found
    print(json.dumps(result, indent=2) if args.json else human_summary(result))
    return 0


# Libraries transformers imports wherever they are installed, for what an estimate never runs: scikit-learn
# (assisted generation's confidence threshold) and scipy (object-detection losses): 1.5 s of a cold command on
# 2 cores.
UNUSED_BY_ESTIMATES = ("sklearn", "scipy")


def without_unused_libraries_in_transformers() -> None:
    """This command's process tells transformers, before it looks, that UNUSED_BY_ESTIMATES are not installed
    (a transformers that looks elsewhere only costs the time again)."""
    import transformers.utils

    for name in UNUSED_BY_ESTIMATES:
        setattr(transformers.utils, f"is_{name}_available", lambda: False)


def layout_text(result: dict) -> str:
    from pipeline.training.layout import Layout

    return Layout(result["num_gpus"], result["sharding"], result["shard_group"], result["tensor_parallel"]).describe()


def adapter_text(adapter: dict) -> str:
    base = f"{adapter['quantization']} base" if adapter["quantization"] else "frozen base"
    return f", LoRA r={adapter['lora_r']} on {adapter['lora_targets']} ({base})"


def human_summary(result: dict) -> str:
    client = {"trainer": "Trainer", "sft": "SFTTrainer", "dpo": "DPOTrainer", "grpo": "GRPOTrainer",
              "rloo": "RLOOTrainer"}.get(result["client"])
    optimizer = result["optimizer"] if client is None else f"{client}, {result['optim']}"
    optimizer += ", Liger" if result["liger_kernel"] else ""
    optimizer += f", {result['completion_share']:g} of positions labelled" if result["completion_share"] != 1 else ""
    accumulation = result["gradient_accumulation"]
    lines = [f"{result['method']}: {result['peak_bytes'] / GIB:.2f} GiB peak for N = {result['parameters']:,} "
             f"at B={result['batch_size']}, L={result['seq_len']}, {result['precision']}, {optimizer}"
             + (f", K={accumulation}" if accumulation > 1 else "") + (", checkpointing" if result["checkpointing"] else "")
             + (f", one GPU of {layout_text(result)}" if result["num_gpus"] > 1 else "")
             + (adapter_text(result["adapter"]) if result["adapter"] else "")]
    if result.get("rollout"):
        r = result["rollout"]
        lines.append(f"  {r['num_generations']} completions per prompt of {r['max_completion_length']} tokens "
                     f"(prompts of {result['seq_len']}), beta {r['beta']:g}"
                     + (", a reference model" if r["reference_model"] else ""))
    if result.get("padding_free"):
        lines.append("  " + ("packed rows" if result["packing"] else "padding-free rows")
                     + f": each micro-batch one row of {result['batch_size'] * result['seq_len']:,} tokens (every row "
                     "full), position ids restarting at each document")
    if result.get("vllm_pool_bytes"):
        lines.append(f"  vLLM's pool (colocate)   {result['vllm_pool_bytes'] / GIB:10.2f} GiB beside the step, in the "
                     "verdict")
    if result.get("phase_peaks") and result["client"] in ROLLOUT_CLIENTS:
        lines.append("  peak in " + result["peak_phase"] + "; by phase: " + ", ".join(
            f"{phase} {value / GIB:.2f}" for phase, value in result["phase_peaks"].items()) + " GiB")
        steps = result["step_peaks"]
        first = next(i for i, value in enumerate(steps) if value == steps[-1]) + 1
        lines.append(f"  the peak is reached at step {first} of {len(steps)}"
                     + (" (the optimizer state, made at the first step's end, is held from the second on)"
                        if first > 1 else ""))
    for name, value in (result["components"] or {}).items():
        lines.append(f"  {name:<24} {value / GIB:10.2f} GiB")
    lines.append(f"  {'peak reserved':<24} {result['peak_reserved_bytes'] / GIB:10.2f} GiB (the allocator's segments)")
    if result.get("host_peak_bytes") is not None:
        lines.append(f"  {'host memory':<24} {result['host_peak_bytes'] / GIB:10.2f} GiB per process (ZeRO-Offload's "
                     "partitions, gradients and optimizer state on the CPU; not in the GPU's verdict)")
    if "fits" in result:
        lines.append(f"  fits {result['gpu']} ({result['device_total_bytes'] / GIB:.1f} GiB; reserved + "
                     f"{result['outside_bytes'] / GIB:.2f} GiB outside PyTorch): {'yes' if result['fits'] else 'no'}"
                     f", headroom {result['headroom_bytes'] / GIB:.2f} GiB")
        if result.get("expandable_segments_would_fit") and not result["fits"]:
            lines.append("  fits with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    if result.get("worst_step"):
        worst = result["worst_step"]
        lines.append(f"  worst step of your {worst['documents']:,} documents: {worst['tokens']:,} tokens, peak "
                     f"{worst['peak_bytes'] / GIB:.2f} GiB, reserved {worst['peak_reserved_bytes'] / GIB:.2f} GiB"
                     + (f", fits: {'yes' if worst['fits'] else 'no'}" if "fits" in worst else ""))
    for name in ("max_batch_size", "max_seq_len"):
        if name in result:
            lines.append(f"  {name.replace('_', ' ')}: {result[name]}")
    lines += [f"  note: {note}" for note in result.get("notes", [])]
    return "\n".join(lines)


def layouts_summary(result: dict) -> str:
    from pipeline.estimate.layout_search import table_text

    head = (f"{result['method']}: {result['model_id'] or result['parameters']} at B={result['batch_size']} per "
            f"data-parallel rank, L={result['seq_len']}, {result['precision']}, {result['client']}"
            + (", checkpointing" if result["checkpointing"] else "") + f", on {result['gpu']}")
    lines = [head]
    if "min_gpus" in result:
        best = result["layout"]
        lines.append(f"  fewest GPUs that fit: {result['min_gpus'] or 'none up to the limit'}"
                     + (f" ({best['layout']}, headroom {best['headroom_bytes'] / GIB:.1f} GiB)" if best else ""))
    lines.append(table_text(result["layouts"]))
    return "\n".join(lines)
