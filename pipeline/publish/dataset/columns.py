"""Column documentation: unit and meaning of every column of every subset (the card's tables).

A column without a description here fails the build, so the card cannot fall behind the tables.
"""

from __future__ import annotations

from pipeline.formulas.features import FEATURES
from pipeline.formulas.hook_features import HOOK_FEATURES, HOOK_ONLY_TERMS

PROVENANCE = {
    "torch_version": ("", "PyTorch version that produced the row"),
    "transformers_version": ("", "transformers version that built the model (activation counts depend on it)"),
    "cuda_version": ("", "CUDA version PyTorch was built with (empty on CPU builds)"),
    "python_version": ("", "Python version"),
    "git_commit": ("", "commit of this project's code that produced the row (-dirty: uncommitted changes)"),
    "device": ("", "device the number comes from: GPU name, or cpu (...) for meta-device counts"),
    "driver_version": ("", "NVIDIA driver version (empty on CPU)"),
    "config_source": ("", "where the model config came from: hub (config.json download) or embedded (registry facts)"),
    "config_revision": ("", "Hub commit of the config.json when known"),
}

# column -> (unit, meaning). Units are also in the names: *_bytes, *_elements, *_per_token.
COLUMNS = {
    **PROVENANCE,
    "model_id": ("", "Hugging Face model id (owner/name)"),
    "family": ("", "model family; the group left out in leave-one-family-out cross-validation"),
    "model_type": ("", "transformers model_type of the config"),
    "status": ("", "ok, or why there is no number: oom, skipped, error"),
    "reason": ("", "why the row is not ok (empty when ok)"),
    "parameters": ("parameters", "N: parameters of the model built from its config, shared/tied weights counted once"),
    "embedding_parameters": ("parameters", "parameters of the input (and untied output) embeddings"),
    "non_embedding_parameters": ("parameters", "parameters minus embedding parameters"),
    "active_parameters": ("parameters", "parameters used per token (differs from N for mixture-of-experts)"),
    "is_moe": ("", "the model is a mixture of experts"),
    "num_experts": ("count", "experts per MoE layer (empty for dense models)"),
    "num_experts_per_tok": ("count", "experts routed per token (empty for dense models)"),
    "num_hidden_layers": ("count", "transformer layers"),
    "hidden_size": ("elements", "width of the residual stream"),
    "intermediate_size": ("elements", "width of the MLP"),
    "num_attention_heads": ("count", "query heads"),
    "num_key_value_heads": ("count", "key/value heads"),
    "head_dim": ("elements", "width of one attention head"),
    "vocab_size": ("tokens", "vocabulary size"),
    "context_length": ("tokens", "longest position the model takes (empty when unlimited)"),
    "tie_word_embeddings": ("", "input and output embeddings share their weights"),
    "attention_kind": ("", "mha, gqa, mqa, mla or none (attention-free)"),
    "method": ("", "hook: sum of module outputs of a forward in eval/no_grad (the blog's method); "
                   "saved: distinct storages autograd saves for backward in the standard step's forward"),
    "dtype": ("", "dtype of the forward (element size for the byte columns)"),
    "batch_size": ("sequences", "B, sequences per batch"),
    "seq_len": ("tokens", "L, tokens per sequence"),
    "tokens": ("tokens", "B x L"),
    "elements": ("elements", "activation elements counted for the whole input"),
    "elements_per_token": ("elements/token", "elements / tokens"),
    "bytes": ("bytes", "activation bytes for the whole input (elements x element size)"),
    "bytes_per_token": ("bytes/token", "bytes / tokens"),
    "forward": ("", "where the forward ran: meta (no weights), meta-fallback, or cpu"),
    "seconds": ("s", "wall time of the count"),
    "precision": ("", "fp32, bf16 (bf16 weights, grads, AdamW state), amp-bf16 (fp32 weights, bf16 autocast), "
                      "amp-fp16 (fp32 weights, fp16 autocast, gradient scaler) or bf16-autocast (bf16 weights, "
                      "grads and state, bf16 autocast: bf16=True on a model loaded in bf16)"),
    "client": ("", "what runs the steps: loop (the standard step), trainer (transformers.Trainer), sft "
                   "(TRL's SFTTrainer: its fused LM head, checkpointing by default), dpo (TRL's DPOTrainer: B "
                   "preference pairs, 2B sequences, a reference model), grpo or rloo (TRL's GRPOTrainer and "
                   "RLOOTrainer: generation in the step, B completions per micro-batch, seq_len the prompt's "
                   "length; definitions)"),
    "liger_kernel": ("", "Liger's kernels (use_liger_kernel=True of the trainer, sft and dpo clients; false "
                         "elsewhere)"),
    "first_in_process": ("", "the point was its measuring process's first (the model built and cuBLAS's workspaces "
                             "made inside it: the simulator replays that process's allocation order)"),
    "completion_share": ("fraction", "share of each sequence's positions that carry a label (sft's completion mask; "
                                     "1.0 elsewhere)"),
    "optim": ("", "the optimizer by its transformers TrainingArguments.optim name (loop SGD with momentum: empty)"),
    "gradient_accumulation": ("count", "micro-batches of B sequences per optimizer step (K)"),
    "lora_r": ("count", "LoRA rank (empty: full fine-tuning)"),
    "lora_alpha": ("", "LoRA alpha (scale; changes no memory)"),
    "lora_targets": ("", "modules given LoRA adapters: all-linear or module names joined by commas"),
    "quantization": ("", "QLoRA base: nf4 (4-bit) or int8 (8-bit) by bitsandbytes; empty: not quantized"),
    "lora_dropout": ("fraction", "LoRA dropout on each adapter's input (PEFT's lora_dropout; 0: none, as in rows written "
                                 "before the column; empty: full fine-tuning)"),
    "trainable_parameters": ("parameters", "parameters that train (the adapters'; N for full fine-tuning)"),
    "num_gpus": ("count", "GPUs of the run (N; 1: one GPU); every peak is one GPU's"),
    "sharding": ("", "how the data-parallel GPUs hold the model: ddp, fsdp (FSDP2, resharding after the forward), "
                     "fsdp-no-reshard, hsdp (FSDP2 over a shard group, replicated across groups), zero1, zero2, zero3 "
                     "(DeepSpeed's ZeRO stage as the Trainer runs it); empty: one GPU or tensor parallelism alone"),
    "deepspeed": ("", "zero1-3: the DeepSpeed config given to the Trainer, as JSON (the Trainer fills its \"auto\" "
                      "values when it runs; empty without DeepSpeed)"),
    "deepspeed_version": ("", "version of DeepSpeed that ran the point (empty without DeepSpeed)"),
    "hyperparameters": ("", "JSON: the TrainingArguments optimizer and schedule numbers the run was given (learning "
                            "rate, warmup_steps, max_steps...; a DeepSpeed config's \"auto\" values come from them); "
                            "empty: TrainingArguments' defaults"),
    "rollout": ("", "grpo, rloo: JSON of the GRPOConfig / RLOOConfig keys the run was given (num_generations, "
                    "max_completion_length, beta, ...); empty: TRL's defaults (grpo 8 completions per prompt, rloo 2, "
                    "512 tokens each)"),
    "phase_peaks": ("", "JSON: the peak allocated bytes of each phase of the step (grpo, rloo: generation and "
                        "log-probs beside forward, backward and optimizer)"),
    "step_peaks": ("", "JSON: the peak allocated bytes so far after each optimizer step (whether the peak moves after "
                       "the first)"),
    "alloc_conf": ("", "PYTORCH_CUDA_ALLOC_CONF of the run (empty: the caching allocator's defaults)"),
    "packing": ("", "sft: JSON of TRL's batching: packing (documents packed into rows of seq_len tokens, best fit "
                    "decreasing) and padding_free (a micro-batch's rows concatenated into one, position ids restarting "
                    "at each document); documents: the token counts of each row's documents; empty: batch_size rows "
                    "of seq_len tokens"),
    "memory_history": ("", "rank 0's allocator history of the point (every malloc and free with its stream; "
                           "pipeline.training.memory_history), a file under the table's folder; empty: not recorded"),
    "host_before_bytes": ("bytes", "the process's resident host memory before training (several GPUs)"),
    "host_peak_bytes": ("bytes", "the process's peak resident host memory (getrusage maxrss; with host_before_bytes "
                                 "it bounds what ZeRO-Offload keeps on the host)"),
    "shard_group": ("count", "hsdp: GPUs one copy of the model is sharded over (empty elsewhere)"),
    "tensor_parallel": ("count", "GPUs each layer's matrices are split over (transformers' tensor-parallel plan; 1: none)"),
    "rank": ("", "the GPU's rank in the run (every rank measured is a row)"),
    "layout": ("", "the run's layout by name: 1 GPU, ddp, fsdp, fsdp-no-reshard, hsdp, fsdp+tp, tp, zero1, zero2 or "
                   "zero3"),
    "nvml_context_bytes": ("bytes", "NVML's used memory of the process before the model was built: the CUDA context "
                                    "and, on several GPUs, NCCL's communicators"),
    "nvml_train_end_bytes": ("bytes", "NVML's used memory of the process after the last step"),
    "reserved_train_end_bytes": ("bytes", "torch.cuda.memory_reserved() after the last step"),
    "reserved_by_stream": ("", "JSON: peak reserved bytes of each CUDA stream's pool (FSDP2's all-gather and "
                               "reduce-scatter streams hold their own)"),
    "exact_peak_bytes": ("bytes", "per-GPU peak allocated predicted by the exact simulator (simulated)"),
    "exact_git_commit": ("", "commit of the code whose exact simulator gave exact_peak_bytes"),
    "formula_peak_bytes": ("bytes", "per-GPU peak allocated predicted by the closed-form formula"),
    "split": ("", "tuned (plans the simulator and formulas may be tuned on) or held-out (models nobody tuned on)"),
    "setting": ("", "full (fine-tuning), lora or qlora (+liger: Liger's kernels, +offload: ZeRO-Offload)"),
    "optimizer": ("", "optimizer of the training step (adamw: torch.optim.AdamW defaults)"),
    "gradient_checkpointing": ("", "gradient checkpointing was on"),
    "attn_implementation": ("", "attention implementation (transformers default when empty)"),
    "variant": ("", "standard: loss from labels (the standard training step); blog: mean of the logits"),
    "peak_allocated_bytes": ("bytes", "torch.cuda.max_memory_allocated() over three training steps, "
                                      "counter reset after the model was built"),
    "peak_reserved_bytes": ("bytes", "torch.cuda.max_memory_reserved() over the same steps"),
    "weights_bytes": ("bytes", "memory allocated right after building the model (weights and buffers)"),
    "optimizer_state_bytes": ("bytes", "memory of the AdamW state after the steps"),
    "forward_peak_bytes": ("bytes", "peak allocated during the forwards (max over the steps)"),
    "backward_peak_bytes": ("bytes", "peak allocated during the backwards (max over the steps)"),
    "optimizer_peak_bytes": ("bytes", "peak allocated during the optimizer steps (max over the steps)"),
    "nvml_used_bytes": ("bytes", "GPU memory of this process as NVML reports it, CUDA context included "
                                 "(empty where NVML cannot see the process)"),
    "nvml_device_used_bytes": ("bytes", "GPU memory in use on the whole device as NVML reports it"),
    "step_seconds": ("s", "wall time of one training step (median of the steps)"),
    "steps": ("count", "training steps run at the point (three)"),
    "steps_seconds_total": ("s", "wall time of all the steps"),
    "step_flops": ("FLOPs", "6 x parameters x B x L: the compute estimate the sweep's budget uses"),
    "allocated_before_bytes": ("bytes", "memory allocated before the point's first step (a leak would show here)"),
    "measure_device": ("", "device type of the measurement: cuda (real peaks) or cpu (debug, no peaks)"),
    "attn_implementation_used": ("", "attention implementation the built model really used"),
    "train_mode": ("", "the model was in train mode (standard step) rather than eval (blog variant)"),
    "use_cache": ("", "the forward used the KV cache (the blog variant's; grpo, rloo: generation, false in rows "
                      "measured before it was switched on)"),
    "allow_tf32": ("", "fp32 matmuls ran on TF32 tensor cores (speed only; memory is the same)"),
    "build_seconds": ("s", "wall time to build the model with random weights on the device"),
    "started_at": ("s since epoch", "when the point started (Unix time)"),
    "finished_at": ("s since epoch", "when the point finished (Unix time)"),
    "child_pid": ("", "process id of the measuring child process (one process per model and precision)"),
    "tokens_per_second": ("tokens/s", "B x L / step_seconds"),
    "gpu_total_bytes": ("bytes", "total memory of the GPU"),
    "estimator": ("", "blog (the blog's formula and coefficients), heuristic (refit coefficients), "
                      "exact (simulated from the model's modules)"),
    "predicted_peak_bytes": ("bytes", "peak predicted by the estimator"),
    "measured_peak_bytes": ("bytes", "measured peak_allocated_bytes (for oom rows: the GPU's memory, a lower bound)"),
    "relative_error": ("ratio", "(predicted - measured) / measured"),
    "fits_predicted": ("", "the estimator says the point fits in gpu_memory_bytes"),
    "fits_measured": ("", "the point ran without running out of memory"),
    "gpu_memory_bytes": ("bytes", "memory of the GPU the fit decision refers to"),
    "predicted_reserved_bytes": ("bytes", "peak reserved (allocator segments) predicted by the estimator"),
    "measured_reserved_bytes": ("bytes", "measured peak_reserved_bytes (empty for oom rows)"),
    "reserved_relative_error": ("ratio", "(predicted - measured) / measured peak reserved"),
    "outside_bytes": ("bytes", "memory of the process outside PyTorch's allocator that the fit verdict adds "
                               "(CUDA context, kernels, libraries; measured on the H200)"),
    "fits_predicted_reserved": ("", "the fit verdict: predicted reserved + outside_bytes <= gpu_memory_bytes"),
}

# The coefficients subset (coefficients.json flattened; units of a and b are in unit_a, unit_b).
COLUMNS.update({
    "fit": ("", "which fit: hook_elements_vs_<x> (hook elements per token against the x column), "
                "saved_bytes_vs_parameters (saved-for-backward bytes per token), or blog"),
    "role": ("", "heuristic (the top-level a, b the estimator uses), alternative, reference length, point estimate at this "
                 "length, or published (the blog's coefficients, fp32 bytes)"),
    "formula": ("", "the fitted line, y = a * x + b"),
    "weighting": ("", "none: ordinary least squares; relative: weights 1/y^2 (least squares of the relative error)"),
    "x": ("", "the x column of the fit"),
    "y": ("", "the y column of the fit"),
    "a": ("unit_a", "slope"),
    "a_low": ("unit_a", "lower end of the interval of a (bootstrap over models)"),
    "a_high": ("unit_a", "upper end of the interval of a"),
    "b": ("unit_b", "intercept"),
    "b_low": ("unit_b", "lower end of the interval of b"),
    "b_high": ("unit_b", "upper end of the interval of b"),
    "interval_level": ("fraction", "confidence level of the intervals (0.95)"),
    "unit_a": ("", "unit of a"),
    "unit_b": ("", "unit of b"),
    "n_models": ("count", "models in the fit"),
    "n_families": ("count", "families in the fit"),
    "fitted_at": ("", "date of the fit (UTC, ISO 8601)"),
})
for _split, _label in (("in_sample", "in sample"), ("kfold", "shuffled k-fold cross-validation"),
                       ("leave_one_family_out", "leave-one-family-out cross-validation")):
    COLUMNS.update({
        f"{_split}_r2": ("", f"R^2, {_label}"),
        f"{_split}_mape": ("fraction", f"mean absolute percentage error, {_label}"),
        f"{_split}_max_abs_percentage_error": ("fraction", f"worst absolute percentage error, {_label}"),
        f"{_split}_worst_model_id": ("", f"model with the worst error, {_label}"),
    })

# The simulated subset (python -m pipeline simulate-peaks): the exact simulator at each measured point.
COLUMNS.update({
    "simulated_peak_bytes": ("bytes", "peak of the standard training step predicted by the simulator"),
    "simulated_forward_peak_bytes": ("bytes", "simulated peak during the forward"),
    "simulated_backward_peak_bytes": ("bytes", "simulated peak during the backward"),
    "simulated_optimizer_peak_bytes": ("bytes", "simulated peak during the optimizer step"),
    "simulated_saved_bytes": ("bytes", "bytes saved for backward in the simulated forward"),
    "simulated_optimizer_state_bytes": ("bytes", "simulated optimizer state"),
    "simulated_peak_phase": ("", "phase of the step where the simulated peak happens"),
    "simulate_status": ("", "ok, or why the simulator has no number (error, skipped)"),
    "simulate_reason": ("", "why the simulation is not ok (empty when ok)"),
    "simulate_seconds": ("s", "wall time of the simulation"),
    "simulated_peak_reserved_bytes": ("bytes", "peak reserved (the caching allocator's segments) predicted by the "
                                               "simulator, torch.cuda.max_memory_reserved()"),
})

# The features subset (pipeline.formulas.features on configs.json): the closed-form formula's inputs, per model.
COLUMNS.update({
    "parameters_closed_form": ("parameters", "N from config facts in closed form (tied weights once)"),
    "active_parameters_closed_form": ("parameters", "parameters active per token in closed form (MoE: routed experts)"),
    "matmul_parameters": ("parameters", "weights of the forward's matrix products (autocast's bf16 copies: 2 bytes each)"),
    "kernel_fp32": ("", "attention kernel on CUDA in fp32: eager, math (materialises scores) or fused"),
    "kernel_bf16": ("", "attention kernel on CUDA in bf16 and amp-bf16: eager, math or fused"),
    "unread_terms": ("", "config facts the reader could not find (taken as zero or a default)"),
})
COLUMNS.update({f"feature_{_term}": ("elements per token" + (" per unit of L" if _term in ("scores", "scores_dropout",
                                                                                          "mask") else ""), _doc)
                for _term, _doc in FEATURES.items()})
COLUMNS.update({f"feature_{_term}": ("elements per token", f"hook count only: {HOOK_FEATURES[_term]}")
                for _term in HOOK_ONLY_TERMS})

# Same column name, different meaning in one subset: (subset, column) -> (unit, meaning).
SUBSET_COLUMNS: dict[tuple[str, str], tuple[str, str]] = {
    ("coefficients", "batch_size"): ("sequences", "B of the saved-for-backward counts the fit used"),
    ("coefficients", "seq_len"): ("tokens", "L of the saved-for-backward counts the fit used"),
    ("coefficients", "precision"): ("", "precision of the saved-for-backward counts (empty for hook fits)"),
    ("layouts", "part"): ("", "tuned (shaped the formula's layout terms), held-out, or held-out after the fix (run for "
                              "the first time after the one change the held-out part led to)"),
}


def column_doc(subset: str, column: str) -> tuple[str, str] | None:
    return SUBSET_COLUMNS.get((subset, column)) or COLUMNS.get(column)


def undocumented_columns(tables: dict) -> list[str]:
    return [f"{subset}.{column}" for subset, frame in tables.items() for column in frame.columns
            if column_doc(subset, column) is None]
