"""Stage: estimate the peak memory of a training step (blog / heuristic / exact).

The blog's structure (bytes):

    peak = parameters + optimizer_state + max(gradients + optimizer_intermediates, activations)

- `blog`: the blog's formula and coefficients exactly as published: every term N*P with P the
  bytes of the precision, AdamW state 2*N*P, and activations A*B*L*P with A = 4.6894e-4*N + 1.8494e6.
  Its flaws are kept on purpose and listed in `BLOG_NOTES` (and in the JSON's "notes").
- `heuristic`: the same components with our refit coefficients (results/coefficients.json) and
  consistent units, combined as the measured peaks show (`heuristic_peak`: gradients count in
  both branches): A in activation ELEMENTS per token, times bytes per element of the precision,
  times an activations multiplier measured from the peak table; precision-aware components
  (amp-bf16: fp32 weights, gradients and AdamW state, bf16 activations plus the bf16 weight copies
  autocast keeps for backward); SGD keeps one momentum buffer instead of two moments and its step
  needs no weight-sized temporaries; gradient checkpointing scales the B x L activations by a
  measured factor.
- `exact`: the simulator `pipeline.simulate.predict_peak` on the model's config.

`max_batch_size` gives the largest batch that fits a GPU memory size at a sequence length.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import UserError

PRECISIONS = ("fp32", "bf16", "amp-bf16")
OPTIMIZERS = ("adamw", "sgd")
METHODS = ("blog", "heuristic", "exact")
GIB = 2**30
DEFAULT_COEFFICIENTS = Path(__file__).resolve().parent.parent / "results" / "coefficients.json"

# Bytes per parameter of the weights (and their gradients and optimizer state) and per activation element.
WEIGHT_BYTES = {"fp32": 4, "bf16": 2, "amp-bf16": 4}
ACTIVATION_BYTES = {"fp32": 4, "bf16": 2, "amp-bf16": 2}
STATE_BUFFERS = {"adamw": 2, "sgd": 1}  # AdamW: two moments; SGD with momentum: one buffer
# Temporaries of the optimizer step, in weights: the foreach AdamW step needs about one more copy of
# the weights; the measured SGD (momentum) step peaks at weights + momentum + gradients + ~6%.
INTERMEDIATE_BUFFERS = {"adamw": 1, "sgd": 0}
# Under autocast every fp32 weight is cast to a bf16 copy that autograd keeps until backward: it
# lives beside the activations (the saved-for-backward counts of amp-bf16 show it as ~2N bytes).
AMP_WEIGHT_COPY_BYTES = {"amp-bf16": 2}

# The blog has one P per run; for amp-bf16 we take the fp32 bytes of its weights, grads and state.
BLOG_P = {"fp32": 4, "bf16": 2, "amp-bf16": 4}
# The blog's calculator divides activations by this under gradient checkpointing (project brief;
# the calculator's code is not part of the published text).
BLOG_CHECKPOINTING_DIVISOR = 5
BLOG_NOTES = [
    "A = 4.6894e-4*N + 1.8494e6 is fp32 BYTES per token (its hook sums numel*element_size), yet "
    "Activation Memory = A*B*L*P multiplies by P again: 4x too much in fp32, 2x in bf16.",
    "The post states two totals: max(gradients + optimizer intermediates, activations) and "
    "max(gradients, optimizer intermediates, activations); this uses the first.",
    "The hook count sums outputs of every module (containers included) for one token; it is not what "
    "autograd saves for backward and has no term growing with L (attention scores, fp32 logits for the loss).",
    "P is one precision for everything: mixed precision (fp32 weights and state, bf16 activations) is not "
    "covered; here amp-bf16 takes P = 4.",
    "Gradient checkpointing: activations divided by a constant 5, not measured.",
    "The fit misses the post's own example: for Qwen2.5-1.5B it gives A = 2,573,309 bytes per token, "
    "the hook count is 5,065,216.",
    "Measured peaks (H200, standard step) are in the backward or the optimizer step, never in the forward; "
    "in the backward the gradients and the activations are alive together, which the max() leaves out.",
]


# ----------------------------------------------------------------------------- components


def training_components(parameters, activation_elements_per_token, batch, seq, precision, optimizer="adamw",
                        activation_multiplier=1.0, checkpointing_factor=1.0) -> dict:
    """Bytes of each term of the heuristic, in consistent units (see module docstring).

    activations = multiplier x checkpointing factor x A x B x L x bytes per element, plus for
    amp-bf16 the bf16 weight copies (2 bytes x N) that autocast keeps for backward.
    """
    weight = WEIGHT_BYTES[precision]
    activations = (activation_elements_per_token * batch * seq * ACTIVATION_BYTES[precision]
                   * activation_multiplier * checkpointing_factor)
    return {
        "parameters": parameters * weight,
        "gradients": parameters * weight,
        "optimizer_state": STATE_BUFFERS[optimizer] * parameters * weight,
        "optimizer_intermediates": INTERMEDIATE_BUFFERS[optimizer] * parameters * weight,
        "activations": activations + AMP_WEIGHT_COPY_BYTES.get(precision, 0) * parameters,
    }


def blog_components(parameters, batch, seq, precision, optimizer="adamw", checkpointing=False) -> dict:
    """The blog's terms exactly as published (A already in fp32 bytes, times P again)."""
    from pipeline.fit import blog_a_bytes

    p = BLOG_P[precision]
    activations = blog_a_bytes(parameters) * batch * seq * p
    return {
        "parameters": parameters * p,
        "gradients": parameters * p,
        "optimizer_state": STATE_BUFFERS[optimizer] * parameters * p,
        "optimizer_intermediates": parameters * p,
        "activations": activations / BLOG_CHECKPOINTING_DIVISOR if checkpointing else activations,
    }


PEAK_FORMULAS = {
    "blog": "parameters + optimizer_state + max(gradients + optimizer_intermediates, activations)",
    "heuristic": "parameters + optimizer_state + gradients + max(optimizer_intermediates, activations)",
    "exact": "simulated peak; components are the live bytes by role at that moment",
}


def blog_peak(c: dict) -> float:
    """The blog's total: weights + state + max(gradients + optimizer intermediates, activations)."""
    return c["parameters"] + c["optimizer_state"] + max(c["gradients"] + c["optimizer_intermediates"], c["activations"])


def heuristic_peak(c: dict) -> float:
    """weights + state + gradients + max(optimizer intermediates, activations).

    The measured peaks are never in the forward: about half are in the optimizer step (weights +
    state + gradients + intermediates, as the blog says), the others in the backward, where the
    gradients pile up while the activations are still alive; so gradients count in both branches.
    """
    return c["parameters"] + c["optimizer_state"] + c["gradients"] + max(c["optimizer_intermediates"], c["activations"])


# ----------------------------------------------------------------------------- inputs


def check_run(batch, seq, precision, optimizer, method) -> None:
    for name, value in (("batch", batch), ("seq", seq)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise UserError(f"{name} must be a positive integer, got {value!r}")
    if precision not in PRECISIONS:
        raise UserError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    if optimizer not in OPTIMIZERS:
        raise UserError(f"optimizer {optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
    if method not in METHODS:
        raise UserError(f"method {method!r} is not one of {', '.join(METHODS)}")


def resolve_coefficients(coefficients) -> dict:
    """A coefficient dict: given (trusted as loaded), from a path, or from the default path."""
    from pipeline.fit import load_coefficients

    if isinstance(coefficients, dict):
        return coefficients
    if coefficients is None:
        if not DEFAULT_COEFFICIENTS.is_file():
            raise UserError(f"{DEFAULT_COEFFICIENTS}: no coefficient file; run `python -m pipeline fit` "
                            "or pass --coefficients PATH")
        coefficients = DEFAULT_COEFFICIENTS
    return load_coefficients(coefficients)


def check_shape_facts(facts: dict, label: str) -> None:
    """A config.json must state its shape (else transformers silently takes library defaults)."""
    from transformers import CONFIG_MAPPING

    from pipeline.registry import REQUIRED_SHAPE_FACTS

    aliases = CONFIG_MAPPING[facts["model_type"]].attribute_map
    text = facts.get("text_config") if isinstance(facts.get("text_config"), dict) else {}
    for fact in REQUIRED_SHAPE_FACTS:
        names = {fact, aliases.get(fact, fact)}
        if not names & facts.keys() and not names & text.keys():
            raise UserError(f"{label}: field {fact!r}: missing")


def resolve_config(model=None, config=None):
    """(model id, transformers config) from a model id, a config.json path, a dict of its facts, or a config."""
    from pipeline.configs import config_from_dict, resolve_model

    if model is not None and config is not None:
        raise UserError("give one of model and config, not both")
    if model is not None:
        resolved = resolve_model(model_id=model)
        return resolved.model_id, resolved.config
    if isinstance(config, (str, Path)):
        path = Path(config)
        try:
            facts = json.loads(path.read_text())
        except FileNotFoundError:
            raise UserError(f"{path}: config file not found") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            raise UserError(f"{path}: not a readable JSON config file") from None
        if not isinstance(facts, dict):
            raise UserError(f"{path}: not a JSON object")
        config, label = facts, str(path)
    else:
        label = "config"
    if isinstance(config, dict):
        built = config_from_dict(config, label)  # checks model_type first
        check_shape_facts(config, label)
        return str(config.get("_name_or_path") or label), built
    return str(getattr(config, "_name_or_path", "") or "config"), config


def count_parameters(config) -> tuple[int, int]:
    """(N, parameters active per token) of the model built from its config on the meta device."""
    from pipeline.modeling import build_model, parameter_counts

    try:
        counts = parameter_counts(build_model(config, "meta"), config)
    except Exception as exc:  # noqa: BLE001 - a config transformers cannot build is bad input
        raise UserError(f"config cannot be built: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}") from None
    return int(counts["parameters"]), int(counts["active_parameters"])


def parse_parameter_count(params) -> int:
    """N from an int or text such as '1543714304' or '1.5e9' (must be a positive whole number)."""
    if isinstance(params, int) and not isinstance(params, bool) and params > 0:
        return params
    if isinstance(params, str) and params.strip().isdigit() and int(params) > 0:
        return int(params)  # exact, even beyond float precision
    try:
        value = float(params)
    except (TypeError, ValueError):
        raise UserError(f"params {params!r} is not a number") from None
    if not math.isfinite(value) or value <= 0 or value != int(value):
        raise UserError(f"params {params!r} must be a positive whole number")
    return int(value)


# ----------------------------------------------------------------------------- estimators


def heuristic_terms(coefficients: dict, target: Target, precision: str, checkpointing: bool) -> tuple:
    """(A elements per token, activations multiplier, checkpointing factor) from the coefficient file."""
    constants = coefficients["estimator"]
    x = target.active if coefficients.get("x") == "active_parameters" else target.parameters
    elements = coefficients["a"] * x + coefficients["b"]
    multiplier = constants["activation_multiplier"][precision]["value"]
    factor = 1.0
    if checkpointing:
        factor = constants["checkpointing_factor"]["value"]
        if factor is None:
            raise UserError("the coefficient file has no measured gradient-checkpointing factor "
                            "(fit it with a peak table that has checkpointing rows)")
    return elements, multiplier, factor


def exact_peak(config, batch, seq, precision, optimizer, checkpointing, attn_implementation=None):
    """The simulator's prediction: (peak bytes, its components or None)."""
    try:
        from pipeline.simulate import predict_peak
    except ModuleNotFoundError as exc:
        if exc.name != "pipeline.simulate":
            raise
        raise UserError("method 'exact' needs the simulator (pipeline/simulate.py), which is not installed") from None
    result = predict_peak(config, batch_size=batch, seq_len=seq, precision=precision, optimizer=optimizer,
                          gradient_checkpointing=checkpointing, attn_implementation=attn_implementation)
    if isinstance(result, dict):
        peak = result.get("peak_bytes", result.get("peak_allocated_bytes", result.get("predicted_peak_bytes")))
        return float(peak), result.get("components")
    return float(result), None


@dataclass
class Target:
    """What is estimated: a parameter count, and the config when one was given."""

    parameters: int
    model_id: str | None = None
    config: object = None
    active_parameters: int | None = None  # per token (MoE); None: all of them

    @property
    def active(self) -> int:
        return self.parameters if self.active_parameters is None else self.active_parameters

    @property
    def source(self) -> str:
        return "given" if self.config is None else "config (built on the meta device)"


def resolve_target(model=None, config=None, params=None, method="heuristic", active_params=None) -> Target:
    if sum(x is not None for x in (model, config, params)) != 1:
        raise UserError("give exactly one of model, config and params")
    if params is not None:
        if method == "exact":
            raise UserError("method 'exact' needs the model's shape: give a model or a config, not params")
        n = parse_parameter_count(params)
        active = parse_parameter_count(active_params) if active_params is not None else None
        if active is not None and active > n:
            raise UserError(f"active params {active} exceed params {n}")
        return Target(n, active_parameters=active)
    if active_params is not None:
        raise UserError("active params go with params; a model or config gives its own")
    model_id, built = resolve_config(model, config)
    n, active = count_parameters(built)
    return Target(n, model_id, built, active)


def estimate(model=None, config=None, params=None, *, batch, seq, precision, optimizer="adamw",
             checkpointing=False, method="heuristic", coefficients=None, gpu_memory_gib=None,
             attn_implementation=None, active_params=None) -> dict:
    """Peak memory of the standard training step at (batch, seq), with its components (bytes).

    Give one of `model` (registry or Hub id), `config` (config.json path, its dict, or a
    transformers config) or `params` (N; blog and heuristic only; with `active_params` for a MoE
    model, else it counts as dense). `coefficients` is a path or
    a loaded coefficient dict (default: results/coefficients.json; only `heuristic` uses it).
    With `gpu_memory_gib` the answer says whether it fits ("fits", "headroom_bytes").
    """
    check_run(batch, seq, precision, optimizer, method)
    memory = gpu_memory_bytes(gpu_memory_gib) if gpu_memory_gib is not None else None
    target = resolve_target(model, config, params, method, active_params)
    coefficients = resolve_coefficients(coefficients) if method == "heuristic" else None
    return estimate_target(target, batch, seq, precision, optimizer, checkpointing, method, coefficients,
                           attn_implementation, memory)


def estimate_target(target: Target, batch, seq, precision, optimizer, checkpointing, method, coefficients=None,
                    attn_implementation=None, memory_bytes=None) -> dict:
    """`estimate` on resolved inputs (a Target and a loaded coefficient dict)."""
    n = target.parameters
    result = {"method": method, "model_id": target.model_id, "parameters": n, "active_parameters": target.active,
              "parameters_source": target.source,
              "batch_size": batch, "seq_len": seq, "precision": precision, "optimizer": optimizer,
              "checkpointing": bool(checkpointing)}
    if method == "blog":
        from pipeline.fit import blog_a_bytes

        components = blog_components(n, batch, seq, precision, optimizer, checkpointing)
        peak = blog_peak(components)
        result.update(activations_per_token=blog_a_bytes(n),
                      activations_per_token_unit="fp32 bytes (as published; the formula multiplies by P again)",
                      bytes_per_parameter=BLOG_P[precision], notes=BLOG_NOTES)
    elif method == "heuristic":
        elements, multiplier, factor = heuristic_terms(coefficients, target, precision, checkpointing)
        components = training_components(n, elements, batch, seq, precision, optimizer, multiplier, factor)
        peak = heuristic_peak(components)
        result.update(activations_per_token=elements, activations_per_token_unit="elements",
                      bytes_per_activation_element=ACTIVATION_BYTES[precision], activation_multiplier=multiplier,
                      checkpointing_factor=factor if checkpointing else None,
                      coefficients={"a": coefficients["a"], "b": coefficients["b"], "date": coefficients["date"],
                                    "data_sha256": coefficients["data"]["sha256"]},
                      notes=["activations = multiplier x A x B x L x bytes per element"
                             + (" x checkpointing factor" if checkpointing else "")
                             + (" + 2 x N bytes of bf16 weight copies" if precision in AMP_WEIGHT_COPY_BYTES else "")
                             + ", A = a*N + b elements per token from the refit (N: parameters active per token)."])
    else:
        peak, components = exact_peak(target.config, batch, seq, precision, optimizer, checkpointing,
                                      attn_implementation)
        result.update(activations_per_token=None, activations_per_token_unit=None,
                      notes=["simulated by pipeline.simulate.predict_peak"])
    result["components"] = components
    result["peak_formula"] = PEAK_FORMULAS.get(method)
    result["peak_bytes"] = peak
    result["peak_gib"] = peak / GIB
    if memory_bytes is not None:
        result.update(gpu_memory_bytes=memory_bytes, fits=bool(peak <= memory_bytes),
                      headroom_bytes=memory_bytes - peak)
    return result


def gpu_memory_bytes(gib) -> int:
    try:
        value = float(gib)
    except (TypeError, ValueError):
        raise UserError(f"gpu memory {gib!r} is not a number of GiB") from None
    if not math.isfinite(value) or value <= 0:
        raise UserError(f"gpu memory {gib!r} must be a positive number of GiB")
    return int(value * GIB)


def max_batch_size(model=None, config=None, params=None, *, seq, precision, gpu_memory_gib, optimizer="adamw",
                   checkpointing=False, method="heuristic", coefficients=None, attn_implementation=None,
                   active_params=None) -> int:
    """The largest batch whose estimated peak fits `gpu_memory_gib` at sequence length `seq` (0: none)."""
    check_run(1, seq, precision, optimizer, method)
    memory = gpu_memory_bytes(gpu_memory_gib)
    target = resolve_target(model, config, params, method, active_params)
    coefficients = resolve_coefficients(coefficients) if method == "heuristic" else None
    return largest_batch(target, seq, precision, optimizer, checkpointing, method, coefficients,
                         attn_implementation, memory)


def largest_batch(target, seq, precision, optimizer, checkpointing, method, coefficients, attn_implementation,
                  memory_bytes, limit: int = 2**24) -> int:
    def peak(batch: int) -> dict:
        return estimate_target(target, batch, seq, precision, optimizer, checkpointing, method, coefficients,
                               attn_implementation)

    def fits(batch: int) -> bool:
        return peak(batch)["peak_bytes"] <= memory_bytes

    if not fits(1):
        return 0
    if method != "exact":
        # activations(B) = fixed + k*B, and the rest of the peak does not depend on B: solve, then check.
        one, two = peak(1)["components"], peak(2)["components"]
        k = two["activations"] - one["activations"]
        room = memory_bytes - one["parameters"] - one["optimizer_state"]
        if method == "heuristic":
            room -= one["gradients"]
        guess = max(1, int((room - (one["activations"] - k)) // k))
        while fits(guess + 1):
            guess += 1
        while guess > 1 and not fits(guess):
            guess -= 1
        return guess
    low, high = 1, 2  # the simulator's peak grows with B: double, then bisect
    while high <= limit and fits(high):
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


# ----------------------------------------------------------------------------- command line


def add_cli(subparsers) -> None:
    from pipeline.arguments import positive_int

    parser = subparsers.add_parser("estimate", help="estimate the peak memory of a training step")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="registry or Hugging Face model id")
    source.add_argument("--config", help="path of a Hugging Face config.json")
    source.add_argument("--params", help="parameter count N (blog and heuristic only)")
    parser.add_argument("--active-params", help="with --params: parameters active per token (MoE; default N)")
    parser.add_argument("--batch", type=positive_int, help="batch size B (optional with --max-batch-size)")
    parser.add_argument("--seq", type=positive_int, required=True, help="sequence length L")
    parser.add_argument("--precision", choices=PRECISIONS, required=True)
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing")
    parser.add_argument("--method", choices=METHODS, default="heuristic")
    parser.add_argument("--coefficients", default=None, help=f"coefficient file (default {DEFAULT_COEFFICIENTS})")
    parser.add_argument("--gpu-memory", type=float, default=None, metavar="GIB", help="GPU memory in GiB")
    parser.add_argument("--max-batch-size", action="store_true", help="the largest B that fits --gpu-memory")
    parser.add_argument("--attn-implementation", default=None, help="for --method exact")
    parser.add_argument("--json", action="store_true", help="print the answer as JSON")
    parser.set_defaults(handler=_estimate_command)


def _estimate_command(args) -> int:
    if args.max_batch_size and args.gpu_memory is None:
        raise UserError("--max-batch-size needs --gpu-memory GIB")
    if args.batch is None and not args.max_batch_size:
        raise UserError("--batch B is required (unless --max-batch-size)")
    check_run(args.batch or 1, args.seq, args.precision, args.optimizer, args.method)
    memory = gpu_memory_bytes(args.gpu_memory) if args.gpu_memory is not None else None
    target = resolve_target(args.model, args.config, args.params, args.method, args.active_params)
    coefficients = resolve_coefficients(args.coefficients) if args.method == "heuristic" else None
    run = (args.seq, args.precision, args.optimizer, args.checkpointing, args.method, coefficients,
           args.attn_implementation)
    largest = largest_batch(target, *run, memory) if args.max_batch_size else None
    result = estimate_target(target, args.batch or max(largest, 1), *run, memory)
    if largest is not None:
        result["max_batch_size"] = largest
    print(json.dumps(result, indent=2) if args.json else human_summary(result))
    return 0


def human_summary(result: dict) -> str:
    lines = [f"{result['method']}: {result['peak_bytes'] / GIB:.2f} GiB peak for N = {result['parameters']:,} "
             f"at B={result['batch_size']}, L={result['seq_len']}, {result['precision']}, {result['optimizer']}"
             + (", checkpointing" if result["checkpointing"] else "")]
    for name, value in (result["components"] or {}).items():
        lines.append(f"  {name:<24} {value / GIB:10.2f} GiB")
    if "fits" in result:
        lines.append(f"  fits {result['gpu_memory_bytes'] / GIB:g} GiB: {'yes' if result['fits'] else 'no'}")
    if "max_batch_size" in result:
        lines.append(f"  max batch size: {result['max_batch_size']}")
    return "\n".join(lines)
