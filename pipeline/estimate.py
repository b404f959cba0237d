"""Stage: estimate the peak memory of a training step (blog / heuristic / exact).

One estimator object per method (`ESTIMATORS`), each with `predict(target, run) -> Estimate`:

- `BlogEstimator`: the blog's formula and coefficients exactly as published (`pipeline.formulas`:
  every term N*P, activations A*B*L*P with A in fp32 bytes). Its flaws are kept on purpose and
  listed in `BLOG_NOTES` (and in the JSON's "notes").
- `HeuristicEstimator(coefficients)`: the same components with our refit coefficients
  (results/coefficients.json) in consistent units, combined as the measured peaks show
  (`heuristic_peak`: gradients count in both branches), with the activations multiplier and the
  gradient-checkpointing factor measured from the peak table; precision-aware (amp-bf16) and
  optimizer-aware (SGD: one momentum buffer, no weight-sized temporaries).
- `ExactEstimator`: the simulator `pipeline.simulate.predict_peak` on the model's config.

`max_batch_size` gives the largest batch that fits a GPU memory size at a sequence length, by
one search for every estimator (the peak grows with the batch).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from pipeline.coefficients import resolve_coefficients
from pipeline.errors import UserError
from pipeline.formulas import (ACTIVATION_BYTES, AMP_WEIGHT_COPY_BYTES, BLOG_NOTES, BLOG_P, OUTSIDE_MAX,
                               PEAK_FORMULAS, blog_a_bytes, blog_components, blog_peak, heuristic_peak,
                               training_components)
from pipeline.vocabulary import METHODS, OPTIMIZERS, PRECISIONS, check_choice, check_positive_int

GIB = 2**30
BATCH_LIMIT = 2**24  # the search for the largest batch stops doubling here


# ----------------------------------------------------------------------------- values


@dataclass(frozen=True)
class Run:
    """The training step being estimated: its shape and settings."""

    batch: int
    seq: int
    precision: str
    optimizer: str = "adamw"
    checkpointing: bool = False
    attn_implementation: str | None = None  # exact only; None: the library's default

    def __post_init__(self):
        check_positive_int("batch", self.batch)
        check_positive_int("seq", self.seq)
        check_choice("precision", self.precision, PRECISIONS)
        check_choice("optimizer", self.optimizer, OPTIMIZERS)
        object.__setattr__(self, "checkpointing", bool(self.checkpointing))

    def with_batch(self, batch: int) -> Run:
        return replace(self, batch=batch)


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


@dataclass
class Estimate:
    """One estimator's answer: the peak, its components (bytes) and what the method adds to the answer."""

    peak_bytes: float
    components: dict | None
    details: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------- estimators


class Estimator:
    """An estimator of the peak: `predict(target, run)`; built by `load(coefficients)` from the user's options."""

    name = ""
    needs_config = False  # True: a parameter count is not enough, it needs the model's shape

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
    """A formula whose activations grow linearly with B, the rest of the peak not at all."""

    def guess_batch(self, target: Target, run: Run, memory_bytes) -> int | None:
        one = self.predict(target, run.with_batch(1)).components
        two = self.predict(target, run.with_batch(2)).components
        per_batch = two["activations"] - one["activations"]
        if per_batch <= 0:
            return None
        room = memory_bytes
        for name in OUTSIDE_MAX[self.name]:
            room -= one[name]
        return max(1, int((room - (one["activations"] - per_batch)) // per_batch))


class BlogEstimator(ClosedFormEstimator):
    name = "blog"

    def predict(self, target: Target, run: Run) -> Estimate:
        n = target.parameters
        components = blog_components(n, run.batch, run.seq, run.precision, run.optimizer, run.checkpointing)
        return Estimate(blog_peak(components), components, {
            "activations_per_token": blog_a_bytes(n),
            "activations_per_token_unit": "fp32 bytes (as published; the formula multiplies by P again)",
            "bytes_per_parameter": BLOG_P[run.precision], "notes": BLOG_NOTES})


@dataclass
class HeuristicEstimator(ClosedFormEstimator):
    coefficients: dict  # a loaded coefficient file

    name = "heuristic"

    @classmethod
    def load(cls, coefficients=None) -> HeuristicEstimator:
        return cls(resolve_coefficients(coefficients))

    def terms(self, target: Target, run: Run) -> tuple:
        """(A elements per token, activations multiplier, checkpointing factor) from the coefficient file."""
        c = self.coefficients
        constants = c["estimator"]
        x = target.active if c.get("x") == "active_parameters" else target.parameters
        elements = c["a"] * x + c["b"]
        multipliers = constants["activation_multiplier"]  # a file fitted before amp-fp16: amp-bf16's for it
        multiplier = multipliers.get(run.precision, multipliers["amp-bf16"])["value"]
        factor = 1.0
        if run.checkpointing:
            factor = constants["checkpointing_factor"]["value"]
            if factor is None:
                raise UserError("the coefficient file has no measured gradient-checkpointing factor "
                                "(fit it with a peak table that has checkpointing rows)")
        return elements, multiplier, factor

    def predict(self, target: Target, run: Run) -> Estimate:
        elements, multiplier, factor = self.terms(target, run)
        components = training_components(target.parameters, elements, run.batch, run.seq, run.precision,
                                         run.optimizer, multiplier, factor)
        c = self.coefficients
        note = ("activations = multiplier x A x B x L x bytes per element"
                + (" x checkpointing factor" if run.checkpointing else "")
                + (" + 2 x N bytes of bf16 weight copies" if run.precision in AMP_WEIGHT_COPY_BYTES else "")
                + ", A = a*N + b elements per token from the refit (N: parameters active per token).")
        return Estimate(heuristic_peak(components), components, {
            "activations_per_token": elements, "activations_per_token_unit": "elements",
            "bytes_per_activation_element": ACTIVATION_BYTES[run.precision], "activation_multiplier": multiplier,
            "checkpointing_factor": factor if run.checkpointing else None,
            "coefficients": {"a": c["a"], "b": c["b"], "date": c["date"], "data_sha256": c["data"]["sha256"]},
            "notes": [note]})


class ExactEstimator(Estimator):
    name = "exact"
    needs_config = True

    def predict(self, target: Target, run: Run) -> Estimate:
        peak, components = exact_peak(target.config, run.batch, run.seq, run.precision, run.optimizer,
                                      run.checkpointing, run.attn_implementation)
        return Estimate(peak, components, {"activations_per_token": None, "activations_per_token_unit": None,
                                           "notes": ["simulated by pipeline.simulate.predict_peak"]})


ESTIMATORS = {"blog": BlogEstimator, "heuristic": HeuristicEstimator, "exact": ExactEstimator}  # by METHODS


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


# ----------------------------------------------------------------------------- inputs


def resolve_config(model=None, config=None):
    """(model id, transformers config) from a model id, a config.json path, a dict of its facts, or a config."""
    from pipeline.configs import config_from_dict, resolve_model
    from pipeline.registry import check_shape_facts

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


def resolve_target(model=None, config=None, params=None, method="heuristic", active_params=None) -> Target:
    if sum(x is not None for x in (model, config, params)) != 1:
        raise UserError("give exactly one of model, config and params")
    if params is not None:
        if ESTIMATORS[method].needs_config:
            raise UserError(f"method {method!r} needs the model's shape: give a model or a config, not params")
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


def gpu_memory_bytes(gib) -> int:
    try:
        value = float(gib)
    except (TypeError, ValueError):
        raise UserError(f"gpu memory {gib!r} is not a number of GiB") from None
    if not math.isfinite(value) or value <= 0:
        raise UserError(f"gpu memory {gib!r} must be a positive number of GiB")
    return int(value * GIB)


def prepare(method, coefficients, model=None, config=None, params=None, active_params=None):
    """(estimator, target) for a method and what is estimated; one-line UserError for bad input."""
    check_choice("method", method, METHODS)
    target = resolve_target(model, config, params, method, active_params)
    return ESTIMATORS[method].load(coefficients), target


# ----------------------------------------------------------------------------- answers


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
    run = Run(batch, seq, precision, optimizer, checkpointing, attn_implementation)
    check_choice("method", method, METHODS)
    memory = gpu_memory_bytes(gpu_memory_gib) if gpu_memory_gib is not None else None
    estimator, target = prepare(method, coefficients, model, config, params, active_params)
    return answer(estimator, target, run, memory)


def answer(estimator: Estimator, target: Target, run: Run, memory_bytes=None) -> dict:
    """The estimate as the JSON answer: what was estimated, the method's details, components and peak."""
    estimated = estimator.predict(target, run)
    peak = estimated.peak_bytes
    result = {"method": estimator.name, "model_id": target.model_id, "parameters": target.parameters,
              "active_parameters": target.active, "parameters_source": target.source,
              "batch_size": run.batch, "seq_len": run.seq, "precision": run.precision, "optimizer": run.optimizer,
              "checkpointing": run.checkpointing, **estimated.details,
              "components": estimated.components, "peak_formula": estimator.peak_formula,
              "peak_bytes": peak, "peak_gib": peak / GIB}
    if memory_bytes is not None:
        result.update(gpu_memory_bytes=memory_bytes, fits=bool(peak <= memory_bytes),
                      headroom_bytes=memory_bytes - peak)
    return result


def max_batch_size(model=None, config=None, params=None, *, seq, precision, gpu_memory_gib, optimizer="adamw",
                   checkpointing=False, method="heuristic", coefficients=None, attn_implementation=None,
                   active_params=None) -> int:
    """The largest batch whose estimated peak fits `gpu_memory_gib` at sequence length `seq` (0: none)."""
    run = Run(1, seq, precision, optimizer, checkpointing, attn_implementation)
    check_choice("method", method, METHODS)
    memory = gpu_memory_bytes(gpu_memory_gib)
    estimator, target = prepare(method, coefficients, model, config, params, active_params)
    return largest_batch(estimator, target, run, memory)


def largest_batch(estimator: Estimator, target: Target, run: Run, memory_bytes, limit: int = BATCH_LIMIT) -> int:
    """The largest B whose predicted peak fits `memory_bytes` (0: none), for any estimator.

    The peak grows with B, so: from 1 (or the estimator's checked guess) double the step while
    the batch fits, then bisect between the last batch that fits and the first that does not.
    """
    def fits(batch: int) -> bool:
        return estimator.predict(target, run.with_batch(batch)).peak_bytes <= memory_bytes

    if not fits(1):
        return 0
    low, high = 1, None
    guess = estimator.guess_batch(target, run, memory_bytes)
    if guess is not None and guess > 1:
        low, high = (guess, None) if fits(guess) else (1, guess)
    ceiling, step = max(limit, 2 * low), 1  # a guess beyond the limit is trusted and checked
    while high is None:
        candidate = low + step
        if candidate > ceiling or not fits(candidate):
            high = candidate
        else:
            low, step = candidate, step * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


# ----------------------------------------------------------------------------- command line


def add_cli(subparsers) -> None:
    from pipeline.arguments import positive_int
    from pipeline.paths import DEFAULT_COEFFICIENTS

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
    run = Run(args.batch or 1, args.seq, args.precision, args.optimizer, args.checkpointing, args.attn_implementation)
    memory = gpu_memory_bytes(args.gpu_memory) if args.gpu_memory is not None else None
    estimator, target = prepare(args.method, args.coefficients, args.model, args.config, args.params,
                                args.active_params)
    largest = largest_batch(estimator, target, run, memory) if args.max_batch_size else None
    result = answer(estimator, target, run.with_batch(args.batch or max(largest, 1)), memory)
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
