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

Every estimator also predicts the allocator's reserved bytes (`torch.cuda.max_memory_reserved()`):
the exact one by replaying the caching allocator's segments, the closed forms as their peak times
the measured reserved/allocated ratio of the coefficient file. The fit verdict is judged on them:
reserved + the memory outside PyTorch (`pipeline.devices`) <= the device's nvidia-smi total.

`max_batch_size` and `max_seq_len` give the largest batch (or sequence length) that fits a GPU, by
one search for every estimator (the peak grows with both).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from pipeline.coefficients import reserved_ratio, resolve_coefficients
from pipeline.devices import DEVICES, Device, custom_device, device, outside_bytes
from pipeline.errors import UserError
from pipeline.formulas import (ACTIVATION_BYTES, AMP_WEIGHT_COPY_BYTES, BLOG_NOTES, BLOG_P, OUTSIDE_MAX,
                               PEAK_FORMULAS, blog_a_bytes, blog_components, blog_peak, heuristic_peak,
                               training_components)
from pipeline.vocabulary import METHODS, OPTIMIZERS, PRECISIONS, check_choice, check_positive_int

GIB = 2**30
BATCH_LIMIT = 2**24  # the search for the largest batch stops doubling here
SEQ_LIMIT = 2**24  # ... and for the longest sequence, when the model has no context length
# Expandable segments map 20 MiB pages (large pool) and 2 MiB pages (small pool): a closed form's
# reserved bytes are its peak plus at most one partly used page of each.
EXPANDABLE_SLACK = (20 + 2) << 20


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
    expandable_segments: bool = False  # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True

    def __post_init__(self):
        check_positive_int("batch", self.batch)
        check_positive_int("seq", self.seq)
        check_choice("precision", self.precision, PRECISIONS)
        check_choice("optimizer", self.optimizer, OPTIMIZERS)
        object.__setattr__(self, "checkpointing", bool(self.checkpointing))
        if not isinstance(self.expandable_segments, bool):
            raise UserError(f"expandable_segments must be true or false, not {self.expandable_segments!r}")

    def with_batch(self, batch: int) -> Run:
        return replace(self, batch=batch)

    def with_seq(self, seq: int) -> Run:
        return replace(self, seq=seq)


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
    reserved_bytes: float | None = None  # torch.cuda.max_memory_reserved(), default allocator settings
    reserved_expandable_bytes: float | None = None  # the same with expandable segments

    def reserved(self, expandable: bool) -> float:
        return self.reserved_expandable_bytes if expandable else self.reserved_bytes


@dataclass(frozen=True)
class Verdict:
    """Whether a step fits a device: its reserved bytes plus the memory outside PyTorch."""

    device: Device
    reserved_bytes: float
    outside_bytes: int
    expandable_reserved_bytes: float

    @property
    def fits(self) -> bool:
        return self.reserved_bytes + self.outside_bytes <= self.device.total_bytes

    @property
    def headroom_bytes(self) -> float:
        return self.device.total_bytes - self.reserved_bytes - self.outside_bytes

    @property
    def expandable_fits(self) -> bool:
        return self.expandable_reserved_bytes + self.outside_bytes <= self.device.total_bytes


def judge(estimated: Estimate, run: Run, dev: Device) -> Verdict:
    return Verdict(dev, estimated.reserved(run.expandable_segments), outside_bytes(dev, run.precision,
                   run.attn_implementation), estimated.reserved_expandable_bytes)


def resolve_device(gpu=None, gpu_memory_gib=None) -> Device | None:
    """The device of the fit verdict: a catalogue name or an nvidia-smi total in GiB (not both)."""
    if gpu is not None and gpu_memory_gib is not None:
        raise UserError("give one of gpu and gpu_memory_gib, not both")
    if gpu is not None:
        if not isinstance(gpu, str):
            raise UserError(f"gpu must be a name, one of {', '.join(DEVICES)}; not {gpu!r}")
        return device(gpu)
    if gpu_memory_gib is not None:
        return custom_device(gpu_memory_bytes(gpu_memory_gib) / GIB)
    return None


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
    """A formula whose activations grow linearly with B, the rest of the peak not at all; its reserved
    bytes are the peak times the measured reserved/allocated ratio."""

    ratio = None  # reserved / allocated: reserved_ratio(coefficients)

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
        for name in OUTSIDE_MAX[self.name]:
            room -= one[name]
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
        n = target.parameters
        components = blog_components(n, run.batch, run.seq, run.precision, run.optimizer, run.checkpointing)
        return self.with_reserved(Estimate(blog_peak(components), components, {
            "activations_per_token": blog_a_bytes(n),
            "activations_per_token_unit": "fp32 bytes (as published; the formula multiplies by P again)",
            "bytes_per_parameter": BLOG_P[run.precision], "notes": list(BLOG_NOTES)}))


@dataclass
class HeuristicEstimator(ClosedFormEstimator):
    coefficients: dict  # a loaded coefficient file

    name = "heuristic"

    @property
    def ratio(self) -> dict:
        return reserved_ratio(self.coefficients)

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
        return self.with_reserved(Estimate(heuristic_peak(components), components, {
            "activations_per_token": elements, "activations_per_token_unit": "elements",
            "bytes_per_activation_element": ACTIVATION_BYTES[run.precision], "activation_multiplier": multiplier,
            "checkpointing_factor": factor if run.checkpointing else None,
            "coefficients": {"a": c["a"], "b": c["b"], "date": c["date"], "data_sha256": c["data"]["sha256"]},
            "notes": [note]}))


class ExactEstimator(Estimator):
    name = "exact"
    needs_config = True

    def predict(self, target: Target, run: Run) -> Estimate:
        result = exact_peak(target.config, run.batch, run.seq, run.precision, run.optimizer, run.checkpointing,
                            run.attn_implementation)
        return Estimate(float(result["peak_bytes"]), result.get("components"), {
            "activations_per_token": None, "activations_per_token_unit": None,
            "notes": ["simulated by pipeline.simulate.predict_peak (reserved: the caching allocator's "
                      "segments replayed)"]}, result["peak_reserved_bytes"], result["peak_reserved_expandable_bytes"])


@dataclass
class FormulaEstimator(ClosedFormEstimator):
    """The closed-form formula of coefficients.json v2 on a config.json dict: no torch, no transformers."""

    coefficients: dict

    name = "formula"
    needs_config = True

    @property
    def ratio(self) -> dict:
        return reserved_ratio(self.coefficients)

    @classmethod
    def load(cls, coefficients=None) -> FormulaEstimator:
        return cls(resolve_coefficients(coefficients))

    def predict(self, target: Target, run: Run) -> Estimate:
        from pipeline.features import read_facts
        from pipeline.formula_peak import peak_group, predict_peak
        from pipeline.hook_features import hook_feature_values

        section = self.coefficients["activation_formula"]
        config = config_dict(target.config)
        facts = read_facts(config)
        group = peak_group(run.precision, run.checkpointing)
        if group not in section["peak"]:
            raise UserError(f"method 'formula': the coefficient file has no peak fit for {group}")
        result = predict_peak(section["peak"], facts, target.parameters, run.batch, run.seq, run.precision,
                              run.optimizer, run.checkpointing, run.attn_implementation)
        hook = section["hook_elements"]["coefficients"]
        elements = sum(hook.get(t, 0.0) * v for t, v in hook_feature_values(facts, config).items())
        return self.with_reserved(Estimate(result["peak_bytes"], result["components"], {
            "activations_per_token": elements, "activations_per_token_unit": "elements (hook method, formula)",
            "unread_terms": list(facts.unread),
            "notes": ["closed-form formula of coefficients.json 'activation_formula': peak = max(optimizer step, "
                      "start of the backward), exact terms from config facts, saved-for-backward bytes fitted per "
                      "term on measured H200 peaks"]}))


ESTIMATORS = {"blog": BlogEstimator, "heuristic": HeuristicEstimator, "exact": ExactEstimator,
              "formula": FormulaEstimator}  # by METHODS


def config_dict(config) -> dict:
    """A config.json dict from a dict or a transformers config."""
    return config if isinstance(config, dict) else config.to_dict()


def formula_target(model=None, config=None) -> Target:
    """The target of the formula: config facts and N in closed form, without building (or importing) a model."""
    from pipeline.features import parameter_count, read_facts

    if model is not None:
        from pipeline.configs import read_config_records
        from pipeline.paths import CONFIGS

        record = read_config_records(CONFIGS).get(model) if Path(CONFIGS).is_file() else None
        if not record or record.get("status") != "ok":
            raise UserError(f"{model}: method 'formula' reads config facts from {CONFIGS} or --config; not there")
        config, label = record["config"], model
    elif isinstance(config, (str, Path)):
        config, label = read_config_file(config), str(config)
    else:
        config, label = config_dict(config), "config"
    if not isinstance(config.get("model_type"), str):
        raise UserError(f"{label}: no model_type in the config")
    facts = read_facts(config)
    if not facts.hidden or not facts.layers or not facts.vocab:
        raise UserError(f"{label}: cannot read the model's shape ({', '.join(facts.unread)})")
    n, active = parameter_count(facts)
    return Target(n, str(config.get("_name_or_path") or label), config, active)


def read_config_file(path) -> dict:
    path = Path(path)
    try:
        facts = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: config file not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        raise UserError(f"{path}: not a readable JSON config file") from None
    if not isinstance(facts, dict):
        raise UserError(f"{path}: not a JSON object")
    return facts


def exact_peak(config, batch, seq, precision, optimizer, checkpointing, attn_implementation=None) -> dict:
    """The simulator's prediction (`predict_peak`'s answer)."""
    try:
        from pipeline.simulate import predict_peak
    except ModuleNotFoundError as exc:
        if exc.name != "pipeline.simulate":
            raise
        raise UserError("method 'exact' needs the simulator (pipeline/simulate.py), which is not installed") from None
    return predict_peak(config, batch_size=batch, seq_len=seq, precision=precision, optimizer=optimizer,
                        gradient_checkpointing=checkpointing, attn_implementation=attn_implementation)


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
    if method == "formula":
        return formula_target(model, config)
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
             checkpointing=False, method="heuristic", coefficients=None, gpu=None, gpu_memory_gib=None,
             attn_implementation=None, active_params=None, expandable_segments=False) -> dict:
    """Peak memory of the standard training step at (batch, seq), with its components (bytes).

    Give one of `model` (registry or Hub id), `config` (config.json path, its dict, or a
    transformers config) or `params` (N; blog and heuristic only; with `active_params` for a MoE
    model, else it counts as dense). `coefficients` is a path or a loaded coefficient dict (default:
    results/coefficients.json). With `gpu` (a catalogue name, `pipeline.devices.DEVICES`) or
    `gpu_memory_gib` (nvidia-smi's total in GiB) the answer says whether it fits ("fits",
    "headroom_bytes"), judged on the reserved bytes plus the memory outside PyTorch;
    `expandable_segments` replays PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.
    """
    run = Run(batch, seq, precision, optimizer, checkpointing, attn_implementation, expandable_segments)
    check_choice("method", method, METHODS)
    dev = resolve_device(gpu, gpu_memory_gib)
    estimator, target = prepare(method, coefficients, model, config, params, active_params)
    return answer(estimator, target, run, dev)


def answer(estimator: Estimator, target: Target, run: Run, dev: Device | None = None) -> dict:
    """The estimate as the JSON answer: what was estimated, the method's details, components, peak,
    reserved bytes and, for a device, the fit verdict."""
    estimated = estimator.predict(target, run)
    peak = estimated.peak_bytes
    result = {"method": estimator.name, "model_id": target.model_id, "parameters": target.parameters,
              "active_parameters": target.active, "parameters_source": target.source,
              "batch_size": run.batch, "seq_len": run.seq, "precision": run.precision, "optimizer": run.optimizer,
              "checkpointing": run.checkpointing, "expandable_segments": run.expandable_segments,
              **estimated.details, "components": estimated.components, "peak_formula": estimator.peak_formula,
              "peak_bytes": peak, "peak_gib": peak / GIB,
              "peak_reserved_bytes": estimated.reserved(run.expandable_segments)}
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


def max_batch_size(model=None, config=None, params=None, *, seq, precision, gpu=None, gpu_memory_gib=None,
                   optimizer="adamw", checkpointing=False, method="heuristic", coefficients=None,
                   attn_implementation=None, active_params=None, expandable_segments=False) -> int:
    """The largest batch that fits the GPU at sequence length `seq` (0: none), by the fit verdict."""
    run = Run(1, seq, precision, optimizer, checkpointing, attn_implementation, expandable_segments)
    check_choice("method", method, METHODS)
    dev = required_device(gpu, gpu_memory_gib)
    estimator, target = prepare(method, coefficients, model, config, params, active_params)
    return largest_batch(estimator, target, run, dev)


def max_seq_len(model=None, config=None, params=None, *, batch, precision, gpu=None, gpu_memory_gib=None,
                optimizer="adamw", checkpointing=False, method="heuristic", coefficients=None,
                attn_implementation=None, active_params=None, expandable_segments=False) -> int:
    """The longest sequence that fits the GPU at batch size `batch` (0: none), by the fit verdict,
    at most the model's context length when its config gives one."""
    run = Run(batch, 1, precision, optimizer, checkpointing, attn_implementation, expandable_segments)
    check_choice("method", method, METHODS)
    dev = required_device(gpu, gpu_memory_gib)
    estimator, target = prepare(method, coefficients, model, config, params, active_params)
    return largest_seq(estimator, target, run, dev)


def required_device(gpu, gpu_memory_gib) -> Device:
    dev = resolve_device(gpu, gpu_memory_gib)
    if dev is None:
        raise UserError("give the GPU: gpu (a name) or gpu_memory_gib")
    return dev


def fits(estimator: Estimator, target: Target, run: Run, dev: Device) -> bool:
    return judge(estimator.predict(target, run), run, dev).fits


def largest_batch(estimator: Estimator, target: Target, run: Run, dev: Device, limit: int = BATCH_LIMIT) -> int:
    """The largest B that fits `dev` (0: none), for any estimator."""
    guess = None
    if isinstance(estimator, ClosedFormEstimator):  # its allocated budget, for a first guess
        room = dev.total_bytes - outside_bytes(dev, run.precision, run.attn_implementation)
        budget = room / estimator.ratio["value"]
        guess = estimator.guess_batch(target, run, budget)
    return largest(lambda batch: fits(estimator, target, run.with_batch(batch), dev), limit, guess)


def largest_seq(estimator: Estimator, target: Target, run: Run, dev: Device) -> int:
    """The largest L that fits `dev` (0: none), at most the model's context length when known."""
    from pipeline.modeling import context_length

    limit = (context_length(target.config) if target.config is not None else None) or SEQ_LIMIT
    return largest(lambda seq: fits(estimator, target, run.with_seq(seq), dev), limit, None, exact_limit=True)


def largest(fit, limit: int, guess: int | None = None, exact_limit: bool = False) -> int:
    """The largest n >= 1 with fit(n) (0: none), for a fit that holds up to some n and not beyond.

    From 1 (or a checked guess) double the step while n fits, then bisect between the last n that
    fits and the first that does not. `limit` stops the doubling; with `exact_limit` no n beyond it
    is tried (else a guess beyond it is trusted and checked).
    """
    if not fit(1):
        return 0
    low, high = 1, None
    if guess is not None and guess > 1 and not (exact_limit and guess > limit):
        low, high = (guess, None) if fit(guess) else (1, guess)
    ceiling, step = (limit if exact_limit else max(limit, 2 * low)), 1
    while high is None:
        candidate = min(low + step, ceiling) if exact_limit else low + step
        if candidate == low:
            return low
        if candidate > ceiling or not fit(candidate):
            high = candidate
        else:
            low, step = candidate, step * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fit(middle) else (low, middle)
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
    parser.add_argument("--seq", type=positive_int, help="sequence length L (optional with --max-seq-len)")
    parser.add_argument("--precision", choices=PRECISIONS, required=True)
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing")
    parser.add_argument("--method", choices=METHODS, default="heuristic")
    parser.add_argument("--coefficients", default=None, help=f"coefficient file (default {DEFAULT_COEFFICIENTS})")
    gpu = parser.add_mutually_exclusive_group()
    gpu.add_argument("--gpu", default=None, metavar="NAME", help=f"the GPU, one of: {', '.join(DEVICES)}")
    gpu.add_argument("--gpu-memory", type=float, default=None, metavar="GIB",
                     help="the GPU's memory in GiB as nvidia-smi reports it (an 80 GB H100: 79.6)")
    parser.add_argument("--expandable-segments", action="store_true",
                        help="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    search = parser.add_mutually_exclusive_group()
    search.add_argument("--max-batch-size", action="store_true", help="the largest B that fits the GPU")
    search.add_argument("--max-seq-len", action="store_true", help="the largest L that fits the GPU")
    parser.add_argument("--attn-implementation", default=None, help="for --method exact")
    parser.add_argument("--json", action="store_true", help="print the answer as JSON")
    parser.set_defaults(handler=_estimate_command)


def _estimate_command(args) -> int:
    searching = "--max-batch-size" if args.max_batch_size else "--max-seq-len" if args.max_seq_len else None
    if searching and args.gpu is None and args.gpu_memory is None:
        raise UserError(f"{searching} needs --gpu NAME or --gpu-memory GIB")
    if args.batch is None and not args.max_batch_size:
        raise UserError("--batch B is required (unless --max-batch-size)")
    if args.seq is None and not args.max_seq_len:
        raise UserError("--seq L is required (unless --max-seq-len)")
    run = Run(args.batch or 1, args.seq or 1, args.precision, args.optimizer, args.checkpointing,
              args.attn_implementation, args.expandable_segments)
    dev = resolve_device(args.gpu, args.gpu_memory)
    estimator, target = prepare(args.method, args.coefficients, args.model, args.config, args.params,
                                args.active_params)
    if args.max_batch_size:
        largest_found = largest_batch(estimator, target, run, dev)
        run = run.with_batch(args.batch or max(largest_found, 1))
    elif args.max_seq_len:
        largest_found = largest_seq(estimator, target, run, dev)
        run = run.with_seq(args.seq or max(largest_found, 1))
    result = answer(estimator, target, run, dev)
    if args.max_batch_size:
        result["max_batch_size"] = largest_found
    elif args.max_seq_len:
        result["max_seq_len"] = largest_found
    print(json.dumps(result, indent=2) if args.json else human_summary(result))
    return 0


def human_summary(result: dict) -> str:
    lines = [f"{result['method']}: {result['peak_bytes'] / GIB:.2f} GiB peak for N = {result['parameters']:,} "
             f"at B={result['batch_size']}, L={result['seq_len']}, {result['precision']}, {result['optimizer']}"
             + (", checkpointing" if result["checkpointing"] else "")]
    for name, value in (result["components"] or {}).items():
        lines.append(f"  {name:<24} {value / GIB:10.2f} GiB")
    lines.append(f"  {'peak reserved':<24} {result['peak_reserved_bytes'] / GIB:10.2f} GiB (the allocator's segments)")
    if "fits" in result:
        lines.append(f"  fits {result['gpu']} ({result['device_total_bytes'] / GIB:.1f} GiB; reserved + "
                     f"{result['outside_bytes'] / GIB:.2f} GiB outside PyTorch): {'yes' if result['fits'] else 'no'}"
                     f", headroom {result['headroom_bytes'] / GIB:.2f} GiB")
        if result.get("expandable_segments_would_fit") and not result["fits"]:
            lines.append("  fits with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    for name in ("max_batch_size", "max_seq_len"):
        if name in result:
            lines.append(f"  {name.replace('_', ' ')}: {result[name]}")
    return "\n".join(lines)
