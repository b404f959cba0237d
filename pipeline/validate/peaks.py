"""Stage: every estimator against every measured peak; the README's headline numbers.

For each `ok` or `oom` row of the standard training step in the peak table and each estimator:

- `blog`: the blog's formula as published;
- `heuristic`: our refit coefficients and constants as written in coefficients.json (in-sample:
  the peak rows may have been used to measure its constants);
- `heuristic-lofo`: the same, refit without the validated model's family (the hook fit from the
  coefficient file's own rows, the empirical constants from the peak table without that family);
- `exact` (with `--exact`): the simulator, once per configuration.

`ok` rows get predicted vs measured `peak_allocated_bytes` and `peak_reserved_bytes`; every row gets
fits or not on the measured GPU's total memory, twice: on the predicted allocated peak
(`fits_predicted`, as before) and by the fit verdict (`fits_predicted_reserved`: predicted reserved +
the memory outside PyTorch <= the GPU's CUDA total, `gpu_total_bytes`; the driver's reserve is the
difference between that and nvidia-smi's total, so only the process's own outside memory is added).
`summarize` makes the markdown and JSON summary.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.formulas.coefficients import reserved_ratio
from pipeline.formulas.gpus import context_bytes
from pipeline.core.errors import UserError
from pipeline.core.text import first_line
from pipeline.estimate.estimators import BlogEstimator, ExactEstimator, FormulaEstimator, HeuristicEstimator
from pipeline.training.values import Estimate, Run, Target
from pipeline.core.paths import COEFFICIENTS, CONFIGS, PEAKS, VALIDATION
from pipeline.core.vocabulary import METHODS, REFITTED_METHODS
from pipeline.training.points import STANDARD_KEY

# Each method, and the fitted ones again refit without the validated model's family ("-lofo").
ESTIMATORS = tuple(name for method in METHODS
                   for name in (method, *([f"{method}-lofo"] if method in REFITTED_METHODS else [])))
KEY_COLUMNS = ["model_id", "model_type", "family", "parameters", "precision", "optimizer", "gradient_checkpointing",
               "attn_implementation", "variant", "batch_size", "seq_len", "status", "device"]


def measured_rows(peaks):
    """ok and oom rows of the standard step (the estimators model nothing else)."""
    from pipeline.core.io import require_columns

    require_columns(peaks, ["model_id", "family", "parameters", "precision", "optimizer", "gradient_checkpointing",
                             "batch_size", "seq_len", "status", "peak_allocated_bytes", "gpu_total_bytes"],
                     "peak table")
    measured = (peaks["status"] == "oom") | ((peaks["status"] == "ok") & peaks["peak_allocated_bytes"].notna())
    rows = peaks[measured & peaks["gpu_total_bytes"].notna()].copy()
    rows["gradient_checkpointing"] = rows["gradient_checkpointing"].fillna(False).astype(bool)
    if "variant" in rows.columns:
        rows = rows[rows["variant"].fillna("standard") == "standard"]
    for column in KEY_COLUMNS:
        if column not in rows.columns:
            rows[column] = None
    return rows.reset_index(drop=True)


def refit_without_family(coefficients: dict, peaks, family: str) -> dict | None:
    """The coefficient dict refit without one family (None when too few models remain)."""
    import copy

    import numpy as np

    from pipeline.fit.constants import peak_constants
    from pipeline.fit.regression import line, relative_weights

    column = coefficients["x"]
    rows = [r for r in coefficients["data"]["rows"] if r["family"] != family]
    if len(rows) < 2 or len({r[column] for r in rows}) < 2:
        return None
    x = np.array([[r[column]] for r in rows], float)
    y = np.array([r["elements_per_token"] for r in rows], float)
    weights = relative_weights(y) if coefficients["weighting"] == "relative" else None
    fitted = line().fit(x, y, sample_weight=weights)
    refit = copy.deepcopy(coefficients)
    refit["a"], refit["b"] = float(fitted.coef_[0]), float(fitted.intercept_)
    if coefficients["data"].get("inputs", {}).get("peaks"):  # constants were measured: measure them again
        others = peaks[peaks["family"] != family]
        active = {r["model_id"]: r.get("active_parameters") or r["parameters"] for r in coefficients["data"]["rows"]}
        refit["estimator"].update(peak_constants(others, refit["a"], refit["b"], active))
    return refit


def formula_without_family(coefficients: dict, peaks, records: dict, family: str) -> dict:
    """The coefficient dict with the formula's peak fits refit without one family (no intervals)."""
    import copy

    from pipeline.fit.formula import model_features
    from pipeline.fit.peak import fit_peak, peak_table

    facts = model_features(records)
    refit = copy.deepcopy(coefficients)
    refit["activation_formula"]["peak"] = fit_peak(peak_table(peaks[peaks["family"] != family], facts), facts,
                                                   resamples=0)
    return refit


@dataclass
class FormulaOnRows:
    """The formula estimator answering for rows of the peak table, from the configs' facts."""

    estimator: object
    records: dict

    def predict(self, row) -> Estimate:
        record = self.records.get(row.model_id) or {}
        if record.get("status") != "ok":
            raise UserError(f"{row.model_id}: no ok config in the configs file")
        target = Target(int(row.parameters), row.model_id, record["config"])
        return self.estimator.predict(target, Run.from_row(row))


class ExactCache:
    """The simulator's answers, one call per configuration; each model's config built once, when needed."""

    def __init__(self, configs_path):
        from pipeline.inputs.configs import read_config_records

        self.records = read_config_records(configs_path)
        self.configs = {}
        self.answers = {}

    def config(self, model_id: str):
        from pipeline.inputs.configs import resolved_from_record

        if model_id not in self.configs:
            record = self.records.get(model_id) or {}
            if record.get("status") != "ok":
                raise UserError(f"{model_id}: no ok config in the configs file")
            self.configs[model_id] = resolved_from_record(model_id, record).config
        return self.configs[model_id]

    def predict(self, row) -> Estimate:
        attn = row.attn_implementation if isinstance(row.attn_implementation, str) else None
        key = (row.model_id, int(row.batch_size), int(row.seq_len), row.precision, row.optimizer,
               bool(row.gradient_checkpointing), attn)
        if key not in self.answers:
            target = Target(int(row.parameters), row.model_id, self.config(row.model_id))
            # as simulate-peaks reads the sweep's rows (Run.from_row): points after their process's first
            self.answers[key] = ExactEstimator().predict(target, Run(*key[1:], fresh_process=False))
        return self.answers[key]


def simulated_lookup(simulated) -> dict:
    """The simulate stage's table (simulate-peaks) as {point key: row}."""
    missing = [c for c in (*STANDARD_KEY, "simulated_peak_bytes", "simulate_status", "simulate_reason")
               if c not in simulated.columns]
    if missing:
        raise UserError(f"simulated table: missing columns {', '.join(missing)}")
    return {_simulated_key(r): r for r in simulated.to_dict("records")}


def _simulated_key(row) -> tuple:
    get = row.get if isinstance(row, dict) else lambda name: getattr(row, name)
    return tuple(str(get(name)) for name in STANDARD_KEY)


def simulated_peak(lookup: dict, row) -> Estimate:
    """The simulate stage's answer for a row (reserved: None in a table made before it was simulated)."""
    found = lookup.get(_simulated_key(row))
    if found is None:
        raise UserError("point not in the simulated table")
    if found["simulate_status"] != "ok":
        raise UserError(f"simulator: {found['simulate_reason']}")
    reserved = found.get("simulated_peak_reserved_bytes")
    return Estimate(float(found["simulated_peak_bytes"]), None,
                    reserved_bytes=None if reserved is None or reserved != reserved else float(reserved))


class SimulatedTable:
    """The exact estimator's answers read from the simulate stage's table."""

    def __init__(self, simulated):
        self.lookup = simulated_lookup(simulated)

    def predict(self, row) -> Estimate:
        return simulated_peak(self.lookup, row)


@dataclass
class OnRows:
    """An estimator object answering for rows of the peak table."""

    estimator: object  # a pipeline.estimate estimator
    active: dict  # model id -> parameters active per token (MoE); absent: dense

    def predict(self, row) -> Estimate:
        target = Target(int(row.parameters), row.model_id, active_parameters=self.active.get(row.model_id))
        return self.estimator.predict(target, Run.from_row(row))


def validate(peaks, coefficients: dict, configs_path=None, exact: bool = False, simulated=None):
    """The validation table: one row per measured ok/oom point x estimator. The exact estimator
    runs the simulator (`exact`) or reads its answers from the simulate stage's table (`simulated`)."""
    import math

    import pandas as pd

    from pipeline.core.provenance import software

    rows = measured_rows(peaks)
    if rows.empty:
        raise UserError("peak table: no ok or oom rows of the standard training step")
    active = {r["model_id"]: r.get("active_parameters") for r in coefficients["data"]["rows"]}  # MoE: per token
    shared = {"blog": OnRows(BlogEstimator(reserved_ratio(coefficients)), active),
              "heuristic": OnRows(HeuristicEstimator(coefficients), active)}
    if simulated is not None or exact:
        shared["exact"] = SimulatedTable(simulated) if simulated is not None else ExactCache(configs_path)
    records = {}
    if configs_path and Path(configs_path).is_file() and "activation_formula" in coefficients:
        from pipeline.inputs.configs import read_config_records

        records = read_config_records(configs_path)
        shared["formula"] = FormulaOnRows(FormulaEstimator(coefficients), records)
    by_family = {}  # the estimators of a family's rows: the shared ones and its leave-one-family-out refit
    for family in rows["family"].unique():
        refit = refit_without_family(coefficients, peaks, family)
        by_family[family] = {**shared, "heuristic-lofo": None if refit is None else OnRows(HeuristicEstimator(refit),
                                                                                           active)}
        if records:
            by_family[family]["formula-lofo"] = FormulaOnRows(
                FormulaEstimator(formula_without_family(coefficients, peaks, records, family)), records)
    estimators = [e for e in ESTIMATORS if e in shared or e == "heuristic-lofo" or (e == "formula-lofo" and records)]
    records = []
    for row in rows.itertuples(index=False):
        for estimator in estimators:
            predicted, reserved, reason = predicted_or_reason(row, by_family[row.family][estimator])
            measured = float(row.peak_allocated_bytes) if row.status == "ok" else math.nan
            measured_reserved = _measured_reserved(row)
            outside = context_bytes(row.precision, getattr(row, "attn_implementation", None))
            record = {column: getattr(row, column) for column in KEY_COLUMNS}
            record.update(
                estimator=estimator, predicted_peak_bytes=predicted, measured_peak_bytes=measured,
                relative_error=(predicted - measured) / measured if row.status == "ok" else math.nan,
                fits_predicted=None if math.isnan(predicted) else bool(predicted <= row.gpu_total_bytes),
                fits_measured=row.status == "ok", gpu_memory_bytes=row.gpu_total_bytes, reason=reason,
                config_source=getattr(row, "config_source", None), config_revision=getattr(row, "config_revision", None),
                predicted_reserved_bytes=reserved, measured_reserved_bytes=measured_reserved,
                reserved_relative_error=(reserved - measured_reserved) / measured_reserved,
                outside_bytes=outside,
                fits_predicted_reserved=None if math.isnan(reserved)
                else bool(reserved + outside <= row.gpu_total_bytes))
            records.append(record)
    table = pd.DataFrame.from_records(records)
    for name, value in software().items():
        table[name] = value
    return table


def predicted_or_reason(row, source) -> tuple[float, float, str | None]:
    """(peak, reserved, None) or (NaN, NaN, why not): one failing point never stops the stage."""
    import math

    if source is None:  # heuristic-lofo without a refit
        return math.nan, math.nan, "too few models left without this family"
    try:
        estimated = source.predict(row)
    except UserError as exc:
        return math.nan, math.nan, str(exc)
    except Exception as exc:  # noqa: BLE001 - the simulator failing on one model is a row, not a crash
        return math.nan, math.nan, first_line(exc, 200)
    reserved = estimated.reserved_bytes
    return float(estimated.peak_bytes), math.nan if reserved is None else float(reserved), None


def _measured_reserved(row) -> float:
    import math

    value = getattr(row, "peak_reserved_bytes", None)
    if row.status != "ok" or value is None or value != value:
        return math.nan
    return float(value)


# ----------------------------------------------------------------------------- summary


def error_summary(group) -> dict:
    ok = group[group["status"] == "ok"]["relative_error"].abs().dropna()
    judged = group.dropna(subset=["fits_predicted"])
    return {**_error_summary(group, ok, judged), **reserved_summary(group)}


def reserved_summary(group) -> dict:
    """Reserved-bytes errors and the fit verdict's accuracy (reserved + outside memory)."""
    ok = group[group["status"] == "ok"]["reserved_relative_error"].abs().dropna()
    judged = group.dropna(subset=["fits_predicted_reserved", "fits_predicted"])
    right = judged["fits_predicted_reserved"] == judged["fits_measured"]
    right_before = judged["fits_predicted"] == judged["fits_measured"]
    return {
        "reserved_points": int(len(ok)),
        "reserved_median_abs_relative_error": float(ok.median()) if len(ok) else None,
        "reserved_p90_abs_relative_error": float(ok.quantile(0.9)) if len(ok) else None,
        "reserved_worst_abs_relative_error": float(ok.max()) if len(ok) else None,
        "reserved_fit_points": int(len(judged)),
        "reserved_fit_accuracy": float(right.mean()) if len(judged) else None,
        "reserved_fit_corrected": int((right & ~right_before).sum()),  # wrong on allocated, right on reserved
        "reserved_fit_broken": int((~right & right_before).sum()),
    }


def _error_summary(group, ok, judged) -> dict:
    return {
        "points": int(len(ok)),
        "median_abs_relative_error": float(ok.median()) if len(ok) else None,
        "p90_abs_relative_error": float(ok.quantile(0.9)) if len(ok) else None,
        "worst_abs_relative_error": float(ok.max()) if len(ok) else None,
        "median_relative_error": float(group[group["status"] == "ok"]["relative_error"].median()) if len(ok) else None,
        "fit_points": int(len(judged)),
        "fit_accuracy": float((judged["fits_predicted"] == judged["fits_measured"]).mean()) if len(judged) else None,
    }


def summarize(table, coefficients: dict | None = None) -> dict:
    """Median, 90th percentile and worst |relative error| per estimator and per precision, fit/no-fit accuracy."""
    summary = {"overall": {}, "by_precision": {}}
    for estimator, group in table.groupby("estimator", sort=False):
        summary["overall"][estimator] = error_summary(group)
        summary["by_precision"][estimator] = {p: error_summary(g) for p, g in group.groupby("precision")}
    summary["models"] = int(table["model_id"].nunique())
    summary["families"] = int(table["family"].nunique())
    if coefficients is not None:
        summary["activation_fit"] = {
            "formula": coefficients["formula"], "a": coefficients["a"], "b": coefficients["b"],
            "x": coefficients["x"], "weighting": coefficients["weighting"],
            "leave_one_family_out": coefficients["metrics"]["leave_one_family_out"],
            "blog_on_our_counts": coefficients["blog"]["metrics_on_our_hook_counts"],
        }
    return summary


def _pct(value) -> str:
    return "—" if value is None else f"{value:.1%}"


def summary_markdown(summary: dict) -> str:
    lines = [f"Estimated vs measured peak memory of the standard training step "
             f"({summary['models']} models, {summary['families']} families); |relative error| of `ok` points, "
             "fit/no-fit accuracy over `ok` and `oom` points on the measured GPU's memory.", "",
             "| estimator | precision | points | median | 90th pct | worst | median signed | fit/no-fit accuracy |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for estimator, overall in summary["overall"].items():
        for precision, s in [("all", overall), *summary["by_precision"][estimator].items()]:
            lines.append(f"| {estimator} | {precision} | {s['points']} | {_pct(s['median_abs_relative_error'])} | "
                         f"{_pct(s['p90_abs_relative_error'])} | {_pct(s['worst_abs_relative_error'])} | "
                         f"{_pct(s['median_relative_error'])} | {_pct(s['fit_accuracy'])} |")
    lines += ["", "Peak reserved (`torch.cuda.max_memory_reserved()`): |relative error| of `ok` points, and the fit "
                  "verdict (predicted reserved + memory outside PyTorch <= the GPU's memory) over `ok` and `oom` "
                  "points; corrected / broken: points that the allocated-based verdict got wrong / right and this "
                  "one right / wrong.", "",
              "| estimator | points | median | 90th pct | worst | fit/no-fit accuracy | corrected | broken |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for estimator, s in summary["overall"].items():
        lines.append(f"| {estimator} | {s['reserved_points']} | {_pct(s['reserved_median_abs_relative_error'])} | "
                     f"{_pct(s['reserved_p90_abs_relative_error'])} | {_pct(s['reserved_worst_abs_relative_error'])} | "
                     f"{_pct(s['reserved_fit_accuracy'])} | {s['reserved_fit_corrected']} | {s['reserved_fit_broken']} |")
    fit = summary.get("activation_fit")
    if fit:
        lofo, blog = fit["leave_one_family_out"] or {}, fit["blog_on_our_counts"]
        lines += ["", f"Activation fit (hook elements per token at B=L=1): A = {fit['a']:.4e} x N + {fit['b']:.4e}, "
                      f"N = {fit['x'].replace('_', ' ')}, least squares of the {'relative' if fit['weighting'] == 'relative' else 'absolute'} "
                      f"error; leave-one-family-out MAPE {_pct(lofo.get('mape'))}, worst {_pct(lofo.get('max_abs_percentage_error'))} "
                      f"({lofo.get('worst_model_id', '—')}). The blog's coefficients (converted to elements) on the same "
                      f"counts: MAPE {_pct(blog['mape'])}, worst {_pct(blog['max_abs_percentage_error'])} "
                      f"({blog['worst_model_id']})."]
    lines += ["", "`heuristic-lofo`: refit without the validated model's family; `heuristic`: in-sample. "
                  "`formula`: the closed-form formula of config facts (coefficients.json 'activation_formula'), "
                  "in-sample; `formula-lofo`: its peak fits refit without the validated model's family."]
    return "\n".join(lines) + "\n"


# (estimator, formula, sample) of the peak rows of the formula comparison, in order
PEAK_COMPARISON = (("formula", "closed form", "in sample"), ("formula-lofo", "closed form", "leave one family out"),
                   ("heuristic", "A = a*N + b (heuristic)", "in sample"),
                   ("heuristic-lofo", "A = a*N + b (heuristic)", "leave one family out"),
                   ("blog", "blog (as published)", "not fitted"))


def peak_comparison_markdown(summary: dict) -> str:
    """The formula comparison's peak section: |relative error| of the standard step's peak per formula."""
    lines = ["", f"Measured peaks of {summary['models']} models, {summary['families']} families; |relative error| "
             "of `ok` points, fit verdict (fits the measured GPU or not) over `ok` and `oom` points "
             "(validation.parquet).", "",
             "| quantity | formula | sample | points | median | 90th pct | worst | fit verdict right |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for estimator, formula, sample in PEAK_COMPARISON:
        s = summary["overall"].get(estimator)
        if s:
            lines.append(f"| peak, standard step, all precisions | {formula} | {sample} | {s['points']} | "
                         f"{_pct(s['median_abs_relative_error'])} | {_pct(s['p90_abs_relative_error'])} | "
                         f"{_pct(s['worst_abs_relative_error'])} | {_pct(s['fit_accuracy'])} |")
    return "\n".join(lines) + "\n"


def write_peak_comparison(summary: dict, path) -> None:
    """The peak rows of the formula comparison (the fit stage's formula_comparison.md has the count rows)."""
    from pipeline.core.io import write_text

    write_text("# Peak of the standard training step: the formulas compared\n" + peak_comparison_markdown(summary),
               path)


def run_validate(peaks_path, coefficients_path, configs_path, out_path, exact: bool = False,
                 summary_path=None, simulated_path=None, comparison_path=None) -> dict:
    from pipeline.formulas.coefficients import load_coefficients
    from pipeline.core.io import read_table
    from pipeline.core.io import write_json, write_parquet, write_text

    coefficients = load_coefficients(coefficients_path)
    peaks = read_table(peaks_path, "peak-memory")
    simulated = read_table(simulated_path, "simulated") if simulated_path else None
    if exact and simulated is None and not Path(configs_path).is_file():
        raise UserError(f"{configs_path}: configs file not found (needed by --exact)")
    table = validate(peaks, coefficients, configs_path, exact, simulated)
    summary = summarize(table, coefficients)
    summary_path = Path(summary_path) if summary_path else Path(out_path).with_name("validation_summary.md")
    write_parquet(table, out_path)
    write_text(summary_markdown(summary), summary_path)
    write_json(summary, summary_path.with_suffix(".json"))
    write_peak_comparison(summary, comparison_path or Path(out_path).with_name("peak_comparison.md"))
    return summary


def add_cli(subparsers) -> None:
    parser = subparsers.add_parser("validate", help="every estimator against every measured peak")
    parser.add_argument("--peaks", default=PEAKS)
    parser.add_argument("--coefficients", default=COEFFICIENTS)
    parser.add_argument("--configs", default=CONFIGS, help="model configs (for --exact)")
    parser.add_argument("--out", default=VALIDATION)
    parser.add_argument("--summary", default=None, help="markdown summary (default: validation_summary.md beside --out; "
                                                        "JSON beside it)")
    parser.add_argument("--comparison", default=None,
                        help="the formulas' peak comparison (markdown; default: peak_comparison.md beside --out)")
    parser.add_argument("--exact", action="store_true", help="also run the simulator (slow)")
    parser.add_argument("--simulated", default=None,
                        help="the exact estimator's answers from this simulate-peaks table instead of --exact")
    parser.set_defaults(handler=_validate_command)


def _validate_command(args) -> int:
    summary = run_validate(args.peaks, args.coefficients, args.configs, args.out, args.exact, args.summary,
                           args.simulated, args.comparison)
    print(summary_markdown(summary), end="")
    print(f"validate: -> {args.out}")
    return 0
