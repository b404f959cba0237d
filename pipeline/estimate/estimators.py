"""The estimators, one per method (`ESTIMATORS`), each with `predict(target, run) -> Estimate`."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.formulas.coefficients import reserved_ratio, resolve_coefficients
from pipeline.core.errors import UserError
from pipeline.core.vocabulary import METHODS, ROLLOUT_CLIENTS
from pipeline.training.values import Estimate, Run, Target
from pipeline.formulas.components import (ACTIVATION_BYTES, AMP_WEIGHT_COPY_BYTES, BLOG_NOTES, BLOG_P, MEASURED_LIKE,
                                          OUTSIDE_MAX, PEAK_FORMULAS, blog_a_bytes, blog_components, blog_peak,
                                          WeightShape, heuristic_peak, shard_components, training_components)

# Expandable segments map 20 MiB pages (large pool) and 2 MiB pages (small pool): a closed form's
# reserved bytes are its peak plus at most one partly used page of each.
EXPANDABLE_SLACK = (20 + 2) << 20
# Clients only the simulator answers: DPO's policy, reference and paired batches have no closed form.
EXACT_ONLY_CLIENTS = ("dpo", *ROLLOUT_CLIENTS)


class Estimator:
    """An estimator of the peak: `predict(target, run)`; built by `load(coefficients)` from the user's options."""

    name = ""
    needs_config = False  # True: a parameter count is not enough, it needs the model's shape
    reads_facts_only = False  # True: the target comes from config facts, no model is built (no torch)

    @classmethod
    def load(cls, coefficients=None) -> Estimator:
        return cls()

    @property
    def peak_formula(self) -> str:
        return PEAK_FORMULAS[self.name]

    def predict(self, target: Target, run: Run) -> Estimate:
        raise NotImplementedError

    def guess_batch(self, target: Target, run: Run, memory_bytes) -> int | None:
        """A first guess of the largest batch that fits, or None; `largest_batch` checks it."""
        return None


class ClosedFormEstimator(Estimator):
    """A formula whose activations grow linearly with B, the rest of the peak not at all; its reserved
    bytes are the peak times the measured reserved/allocated ratio."""

    ratio = None  # reserved / allocated: reserved_ratio(coefficients)

    @staticmethod
    def check_client(run: Run) -> None:
        if run.client in EXACT_ONLY_CLIENTS:
            raise UserError(f"client {run.client} is estimated by the exact method only (method exact, --method exact)")
        if run.deepspeed is not None:
            raise UserError(f"DeepSpeed's ZeRO ({run.sharding}) is estimated by the exact method only, which runs "
                            "DeepSpeed's code (method exact, --method exact)")

    @staticmethod
    def with_adapter(components: dict, target: Target, run: Run) -> dict:
        """The components with the base frozen (and quantized) and LoRA adapters trained."""
        if run.adapter is None:
            return components
        if target.config is None:
            raise UserError("LoRA needs the model's shape (--model or --config): the adapters' size follows it")
        from pipeline.formulas.adapter_terms import adapter_components
        from pipeline.formulas.features import read_facts

        spec = run.adapter
        return adapter_components(components, read_facts(config_dict(target.config)), target.parameters,
                                  run.precision, run.optimizer_key, spec.r, spec.targets, spec.quantization,
                                  upcast=run.client != "sft")

    def with_reserved(self, estimate: Estimate) -> Estimate:
        estimate.reserved_bytes = estimate.peak_bytes * self.ratio["value"]
        estimate.reserved_expandable_bytes = estimate.peak_bytes + EXPANDABLE_SLACK
        estimate.details["reserved_ratio"] = self.ratio["value"]
        return estimate

    def guess_batch(self, target: Target, run: Run, memory_bytes) -> int | None:
        one = self.predict(target, run.with_batch(1)).components
        two = self.predict(target, run.with_batch(2)).components
        per_batch = two["activations"] - one["activations"]
        if per_batch <= 0:
            return None
        room = memory_bytes
        for name in (*OUTSIDE_MAX[self.name], "ddp_buckets"):
            room -= one.get(name, 0.0)
        return max(1, int((room - (one["activations"] - per_batch)) // per_batch))


class BlogEstimator(ClosedFormEstimator):
    name = "blog"

    def __init__(self, ratio: dict | None = None):
        self.ratio = ratio or reserved_ratio(None)

    @classmethod
    def load(cls, coefficients=None) -> BlogEstimator:
        """The published formula; only the reserved/allocated ratio comes from the coefficient file
        (the built-in one when there is none)."""
        try:
            return cls(reserved_ratio(resolve_coefficients(coefficients)))
        except UserError:
            if coefficients is not None:
                raise
            return cls()

    def predict(self, target: Target, run: Run) -> Estimate:
        self.check_client(run)
        n = target.parameters
        components = sharded(self.with_adapter(blog_components(
            n, run.batch, run.seq, run.precision, run.optimizer_key, run.checkpointing), target, run), run)
        return self.with_reserved(Estimate(blog_peak(components), components, {
            "activations_per_token": blog_a_bytes(n),
            "activations_per_token_unit": "fp32 bytes (as published; the formula multiplies by P again)",
            "bytes_per_parameter": BLOG_P[run.precision], "notes": [*BLOG_NOTES, *closed_form_notes(run)]}))


@dataclass
class FittedEstimator(ClosedFormEstimator):
    """A closed form whose coefficients (and reserved/allocated ratio) come from a coefficient file."""

    coefficients: dict  # a loaded coefficient file

    @property
    def ratio(self) -> dict:
        return reserved_ratio(self.coefficients)

    @classmethod
    def load(cls, coefficients=None) -> FittedEstimator:
        return cls(resolve_coefficients(coefficients))


class HeuristicEstimator(FittedEstimator):
    name = "heuristic"

    def terms(self, target: Target, run: Run) -> tuple:
        """(A elements per token, activations multiplier, checkpointing factor) from the coefficient file."""
        c = self.coefficients
        constants = c["estimator"]
        x = target.active if c.get("x") == "active_parameters" else target.parameters
        elements = c["a"] * x + c["b"]
        multipliers = constants["activation_multiplier"]
        own = multipliers.get(run.precision)
        if not own or not own.get("n_points"):  # not measured: the precision of the same sizes stands in
            own = multipliers.get(MEASURED_LIKE.get(run.precision), own)
        multiplier = own["value"]
        factor = 1.0
        if run.checkpointing:
            factor = constants["checkpointing_factor"]["value"]
            if factor is None:
                raise UserError("the coefficient file has no measured gradient-checkpointing factor "
                                "(fit it with a peak table that has checkpointing rows)")
        return elements, multiplier, factor

    def predict(self, target: Target, run: Run) -> Estimate:
        self.check_client(run)
        elements, multiplier, factor = self.terms(target, run)
        parts = training_components(target.parameters, elements, run.batch, run.seq, run.precision,
                                    run.optimizer_key, multiplier, factor)
        head_note = self.with_fused_head(parts, target, run, multiplier * factor)
        components = sharded(self.with_adapter(parts, target, run), run)
        c = self.coefficients
        note = ("activations = multiplier x A x B x L x bytes per element"
                + (" x checkpointing factor" if run.checkpointing else "")
                + (" + 2 x N bytes of bf16 weight copies" if run.precision in AMP_WEIGHT_COPY_BYTES else "")
                + ", A = a*N + b elements per token from the refit (N: parameters active per token)."
                + head_note)
        return self.with_reserved(Estimate(heuristic_peak(components), components, {
            "activations_per_token": elements, "activations_per_token_unit": "elements",
            "bytes_per_activation_element": ACTIVATION_BYTES[run.precision], "activation_multiplier": multiplier,
            "checkpointing_factor": factor if run.checkpointing else None,
            "coefficients": {"a": c["a"], "b": c["b"], "date": c["date"], "data_sha256": c["data"]["sha256"]},
            "notes": [note, *closed_form_notes(run)]}))

    @staticmethod
    def with_fused_head(parts: dict, target: Target, run: Run, scale: float) -> str:
        """SFTTrainer: the logits' share of the activations (`scale` x V elements per token) replaced by
        the fused head's bytes (`pipeline.formulas.fused_head`), in place; the note that says so."""
        if run.client != "sft":
            return ""
        if target.config is None:
            return " SFTTrainer's fused LM head is not counted: without the model's shape the logits stay in A."
        from pipeline.formulas.features import read_facts
        from pipeline.formulas.fused_head import head_bytes

        facts = read_facts(config_dict(target.config))
        logits = scale * facts.vocab * run.batch * run.seq * ACTIVATION_BYTES[run.precision]
        head = head_bytes(facts.vocab, facts.embed_width or facts.hidden, run.batch, run.seq, run.precision,
                          run.completion_share, run.adapter is None)
        parts["activations"] = max(parts["activations"] - logits, 0.0) + head["saved"] + head["backward"]
        return " SFTTrainer: the logits' share of A (V per token) replaced by its fused LM head's bytes."


class ExactEstimator(Estimator):
    name = "exact"
    needs_config = True

    def predict(self, target: Target, run: Run) -> Estimate:
        from pipeline.estimate.memo import simulated as simulate

        simulated = simulate(target.config, run)
        simulator = ("distributed_peak (DeepSpeed's ZeRO with a fake process group of num_gpus ranks)"
                     if run.deepspeed else "distributed_peak (DDP / FSDP2 with a fake process group of num_gpus ranks)"
                     if run.sharding else "trainer_peak (transformers.Trainer run on the meta device)"
                     if run.client == "trainer" else "sft_peak (TRL's SFTTrainer run on the meta device)"
                     if run.client == "sft" else "dpo_peak (TRL's DPOTrainer and its reference model run on the "
                     "meta device)" if run.client == "dpo" else "rollout_peak (TRL's GRPOTrainer / RLOOTrainer, "
                     "generation included, run on the meta device)" if run.client in ROLLOUT_CLIENTS else "loop_peak")
        return Estimate(simulated.peak_bytes, simulated.components, {
            "activations_per_token": None, "activations_per_token_unit": None,
            "peak_phase": simulated.details.get("peak_phase"),
            **({key: simulated.details[key] for key in ("phase_peaks", "step_peaks")}
               if run.client in ROLLOUT_CLIENTS else {}),
            "notes": [f"simulated by pipeline.simulate.{simulator} (reserved: the caching allocator's "
                      "segments replayed)", *qlora_sharding_notes(run)],
            # ZeRO-Offload: the host memory per process (not in the GPU's verdict)
            **({"host_peak_bytes": simulated.details["host_peak_bytes"]}
               if "host_peak_bytes" in simulated.details else {})}, simulated.reserved_bytes,
            simulated.reserved_expandable_bytes)


def qlora_sharding_notes(run: Run) -> list[str]:
    """What a QLoRA answer under FSDP or ZeRO-3 assumes of the 4-bit base."""
    if run.adapter is None or run.adapter.for_sharding(run.sharding) is run.adapter:
        return []
    return ["the 4-bit base is stored in bfloat16 (bnb_4bit_quant_storage), as FSDP + QLoRA recipes load it, so "
            "that its packed weights shard; each rank first loads the whole 4-bit model on its GPU (the setup "
            "holds it), and keeps its quantization constants whole. Stored as uint8 (bitsandbytes' default), "
            "FSDP2 leaves the 4-bit weights whole on every rank"]


class FormulaEstimator(FittedEstimator):
    """The closed-form formula of coefficients.json v2 on a config.json dict: no torch, no transformers."""

    name = "formula"
    needs_config = True
    reads_facts_only = True

    def predict(self, target: Target, run: Run) -> Estimate:
        self.check_client(run)
        from pipeline.formulas.adapter_terms import (activation_precision, lora_dropout_bytes_per_token,
                                                     lora_saved_bytes_per_token)
        from pipeline.formulas.features import read_facts, weight_shape
        from pipeline.formulas.peak import closed_form_peak, peak_group, peak_of
        from pipeline.formulas.hook_features import hook_feature_values

        section = self.coefficients["activation_formula"]
        config = config_dict(target.config)
        facts = read_facts(config)
        precision = activation_precision(trained_precision(run), run.adapter.quantization if run.adapter else None,
                                         upcast=run.client != "sft")
        try:
            result = closed_form_peak(section["peak"], facts, target.parameters, run.batch, run.seq, precision,
                                      run.optimizer_key, run.checkpointing, run.attn_implementation, run.client,
                                      run.completion_share, head_trainable=run.adapter is None,
                                      liger_kernel=run.liger_kernel, tensor_parallel=run.layout.tensor_parallel)
        except KeyError:
            raise UserError(f"method 'formula': the coefficient file has no peak fit for "
                            f"{peak_group(precision, run.checkpointing)}") from None
        if run.adapter is not None:
            spec = run.adapter
            result["components"]["activations"] += run.batch * run.seq * lora_saved_bytes_per_token(
                facts, spec.targets, run.precision, spec.quantization, run.checkpointing)
            if spec.dropout:
                result["components"]["activations"] += run.batch * run.seq * lora_dropout_bytes_per_token(
                    facts, spec.targets, run.precision, spec.quantization, run.checkpointing, run.client != "sft")
        if run.packing is not None and (run.batch > 1 or len(run.packing.row_documents(run.seq)) > 1):
            from pipeline.formulas.packed_mask import packed_mask_bytes  # one document a step: no mask

            result["components"]["activations"] += packed_mask_bytes(
                facts, run.batch * run.seq, run.checkpointing, run.attn_implementation, ACTIVATION_BYTES[precision])
            result["peak_bytes"], result["peak_phase"] = peak_of(result["components"])
        if run.layout.sharded or run.adapter is not None:
            parts = self.with_adapter(result["components"], target, run)
            shape = weight_shape(facts, target.parameters)
            result["components"] = sharded(parts, run, shape, ACTIVATION_BYTES[trained_precision(run)])
            if "gathered_weights" in result["components"] and run.checkpointing:
                result["components"]["recompute"] = max(result["components"].get("recompute", 0.0), recomputed_layer(
                    section["peak"], facts, run, precision))
            result["peak_bytes"], result["peak_phase"] = peak_of(result["components"])
        hook = section["hook_elements"]["coefficients"]
        elements = sum(hook.get(t, 0.0) * v for t, v in hook_feature_values(facts).items())
        return self.with_reserved(Estimate(result["peak_bytes"], result["components"], {
            "activations_per_token": elements, "activations_per_token_unit": "elements (hook method, formula)",
            "unread_terms": list(facts.unread),
            "notes": ["closed-form formula of coefficients.json 'activation_formula': peak = max(optimizer step, "
                      "start of the backward), exact terms from config facts, saved-for-backward bytes fitted per "
                      "term on measured H200 peaks"
                      + ("; SFTTrainer's fused LM head in place of the logits (pipeline.formulas.fused_head)"
                         if run.client == "sft" else ""), *result["notes"], *closed_form_notes(run)]}))


ESTIMATORS = {estimator.name: estimator for estimator in (BlogEstimator, HeuristicEstimator, FormulaEstimator,
                                                           ExactEstimator)}
assert tuple(ESTIMATORS) == METHODS


def sharded(components: dict, run: Run, shape: WeightShape | None = None, gathered_bytes: int = 2) -> dict:
    """The closed forms' components on one GPU of the run's layout (`formulas.components.shard_components`)."""
    layout = run.layout
    return shard_components(components, layout.sharding, layout.shards, layout.tensor_parallel, shape, gathered_bytes)


def recomputed_layer(peak_fits: dict, facts, run: Run, precision: str) -> float:
    """Bytes of a checkpointed decoder layer recomputed and back-propagated (the formula's fit without
    checkpointing, a tensor-parallel rank's share)."""
    from pipeline.formulas.peak import mlp_backward_bytes, one_layer_bytes

    per_token = one_layer_bytes(peak_fits, facts, run.seq, precision, run.attn_implementation) \
        + mlp_backward_bytes(facts, precision)
    return run.batch * run.seq * per_token / run.layout.tensor_parallel


def trained_precision(run: Run) -> str:
    """The precision the run's weights train in: under FSDP2 a Trainer client's bf16 autocast is accelerate's
    mixed precision instead (its trainable weights upcast to fp32 and gathered in bf16, no autocast: mp-bf16;
    a frozen LoRA base stays bf16); else the run's own."""
    from pipeline.core.vocabulary import precision_mode

    if run.client == "loop" or run.layout.shards < 2 or run.layout.sharding == "ddp" \
            or precision_mode(run.precision).autocast != "bf16":
        return run.precision
    return "mp-bf16" if run.adapter is None else "bf16"


def closed_form_notes(run: Run) -> list:
    """What a closed form leaves out of a run: the blog's formula knows no client, and the closed forms
    model Liger's fused cross-entropy (the formula, in the Trainer) but not its other kernels (the exact
    method runs them)."""
    notes = []
    if run.packing is not None:
        notes.append("packed rows: the closed forms answer B rows of L tokens; the formula adds SDPA's (N, N) "
                     "packed-sequence mask and the bias each layer saves from it (the heuristic and the blog do not; "
                     "method exact runs TRL's packing)")
    if run.liger_kernel:
        notes.append("Liger's RMSNorm, RoPE and SwiGLU kernels are not modelled by the closed forms (an "
                     "over-estimate; method exact runs them)" + ("; the formula models its fused linear "
                     "cross-entropy" if run.client == "trainer" else ""))
    return notes


def config_dict(config) -> dict:
    """A config.json dict from a dict or a transformers config."""
    if isinstance(config, dict):
        return config
    if hasattr(config, "to_dict") and getattr(config, "model_type", None):
        return config.to_dict()
    raise UserError(f"config must be a config.json path, its dict or a transformers config, not {type(config).__name__}")
