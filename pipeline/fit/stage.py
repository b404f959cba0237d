"""Stage: refit and cross-validate the blog's heuristic `A = a * N + b`; write `results/coefficients.json`.

Fits (scikit-learn LinearRegression, one point per registry model with status ok):

- `hook_elements_vs_parameters`: hook-method activation ELEMENTS per token at (B, L) = (1, 1)
  against N, the total parameter count, ordinary least squares. This is the blog's fit in
  consistent units (the blog's published A is fp32 BYTES per token, i.e. 4 x elements).
- `hook_elements_vs_non_embedding_parameters`, `hook_elements_vs_active_parameters`: the same
  against parameters outside the embeddings, and against parameters active per token (MoE:
  routed experts counted top_k / num_experts; dense models: all).
- `hook_elements_vs_active_parameters_relative`: against active parameters, weighted 1/A^2 (least
  squares of the relative error). The heuristic estimator uses this one (the top-level a, b):
  MoE models sit far below any line through dense ones in total N, and unweighted least squares
  lets the few largest models decide the line for all the others.
- `saved_bytes_vs_parameters`: saved-for-backward BYTES per token against N, per precision,
  at a reference (B, L): the smallest L measured for that precision (smallest B there), with
  point estimates at every other L to show how the slope moves with L.

Each fit reports bootstrap 95% intervals for a and b, and R^2, MAE, MAPE and the worst error
in-sample, under shuffled k-fold and under leave-one-family-out cross-validation.

With a peak-memory table the stage also measures the empirical constants the heuristic
estimator uses (an activations multiplier per precision and the gradient-checkpointing factor);
see `pipeline.fit.constants`. The line fits and their cross-validation are in
`pipeline.fit.lines`.

The coefficient file is plain JSON that anyone can use without this code; `pipeline.formulas.coefficients`
holds its schema and reads, checks and writes it; `pipeline.formulas.components` the formulas it feeds.
"""

from __future__ import annotations

import datetime
import hashlib
import json
from pathlib import Path

from pipeline.formulas.coefficients import SCHEMA_VERSION, default_constants, estimator_structure, write_coefficients
from pipeline.fit.lines import (BOOTSTRAP_RESAMPLES, INTERVAL_LEVEL, X_UNITS, blog_evaluation, fit_hook_line,
                               fit_saved_line, hook_rows, plain, rows_sha256)
from pipeline.fit.regression import SEED
from pipeline.core.io import read_table
from pipeline.core.paths import ACTIVATIONS, COEFFICIENTS, CONFIGS, MODELS
from pipeline.fit.constants import peak_constants, peak_rows
from pipeline.core.vocabulary import PRECISIONS

FORMULA_TABLE_HEADER = ("Closed-form activation formula (pipeline/formulas/features.py, fitted by pipeline/fit/formula.py) "
                        "beside A = a*N + b, the blog's published line and Korthikanti et al.; |relative error| "
                        "per model (hook) or per (model, B, L) point (saved bytes).\n\n")
# The peak rows come from the validate stage, which has every estimator's peaks.
PEAK_SECTION_POINTER = ("\n## Peak of the standard training step\n\nIn `peak_comparison.md`, written by the "
                        "validate stage (`python -m pipeline validate`).\n")
# The heuristic estimator's fit: against active parameters (MoE models would otherwise sit far below
# any line through the dense ones) and weighted for relative error (else the largest models decide).
HEURISTIC_FIT = "hook_elements_vs_active_parameters_relative"


def fit_coefficients(models, activations, peaks=None, seed: int = SEED,
                     resamples: int = BOOTSTRAP_RESAMPLES, inputs: dict | None = None, records: dict | None = None) -> dict:
    """Every fit, the blog's evaluation and the estimator's constants, as the coefficient file's dict.

    `records`: configs.json records (the closed-form formula's features); the formula's section is
    fitted from them (`pipeline.fit.formula`).
    """
    from pipeline.fit.formula import fit_formula

    from importlib import metadata

    from pipeline.core.provenance import PACKAGE_VERSION
    from pipeline.core.provenance import software

    rows = hook_rows(models, activations)
    if "active_parameters" not in rows.columns:
        rows["active_parameters"] = None
    rows["active_parameters"] = rows["active_parameters"].fillna(rows["parameters"])  # unknown: taken as dense
    run = {"seed": seed, "resamples": resamples}
    fits = {
        "hook_elements_vs_parameters": fit_hook_line(rows, "parameters", **run),  # the blog's fit, consistent units
        "hook_elements_vs_non_embedding_parameters": fit_hook_line(rows, "non_embedding_parameters", **run),
        "hook_elements_vs_active_parameters": fit_hook_line(rows, "active_parameters", **run),
        HEURISTIC_FIT: fit_hook_line(rows, "active_parameters", weighting="relative", **run),
        "saved_bytes_vs_parameters": {p: fit_saved_line(models, activations, p, **run) for p in PRECISIONS},
    }
    main = fits[HEURISTIC_FIT]
    active = dict(zip(rows["model_id"], rows["active_parameters"]))
    constants = default_constants() if peaks is None else peak_constants(peaks, main["a"], main["b"], active)
    data_hashes = {"hook_rows": main["rows_sha256"]}
    if peaks is not None:
        import pandas as pd

        used = pd.concat([peak_rows(peaks, False), peak_rows(peaks, True)])
        data_hashes["peak_rows"] = rows_sha256(used, ["model_id", "precision", "optimizer", "gradient_checkpointing",
                                                "batch_size", "seq_len", "peak_allocated_bytes"])
    if records is None and Path(CONFIGS).is_file():
        from pipeline.inputs.configs import read_config_records

        records = read_config_records(CONFIGS)
    formula, _ = fit_formula(models, activations, peaks, records or {}, seed=seed)
    versions = software()
    coefficients = {
        "schema_version": SCHEMA_VERSION,
        "formula": "A = a * N + b",
        "description": "Activation elements per token (hook method: outputs of every module, forward of a (1, 1) "
                       "input, eval, no_grad) as a linear function of N, the parameters active per token, fitted "
                       "by least squares of the relative error (the heuristic estimator's fit; the other fits, "
                       "including the blog's kind against all parameters, are under 'fits').",
        "fit": HEURISTIC_FIT,
        "x": "active_parameters",
        "weighting": "relative",
        "units": {
            "N": X_UNITS["active_parameters"] + " (count)",
            "A": "activation elements per token (multiply by bytes per element of the precision for bytes)",
            "a": "elements per token per parameter",
            "b": "elements per token",
        },
        "a": main["a"],
        "b": main["b"],
        "intervals": {"a": main["intervals"]["a"], "b": main["intervals"]["b"], "level": INTERVAL_LEVEL,
                      "method": main["intervals"]["method"], "resamples": resamples, "seed": seed},
        "metrics": main["metrics"],
        "n_models": main["n_models"],
        "n_families": main["n_families"],
        "fits": fits,
        "estimator": {**estimator_structure(), **constants},
        "blog": blog_evaluation(rows),
        "activation_formula": formula,
        "data": {
            "sha256": hashlib.sha256(json.dumps(data_hashes, sort_keys=True).encode()).hexdigest(),
            "sha256_of_rows": data_hashes,
            "how": "SHA-256 of JSON lines (sorted keys) of the rows used, sorted by every column; "
                   "sha256 is the hash of the JSON of the per-table hashes",
            "inputs": {k: str(v) for k, v in (inputs or {}).items()},
            "rows": plain(rows.to_dict("records")),
        },
        "versions": {
            "torch": versions["torch_version"],
            "transformers": versions["transformers_version"],
            "scikit-learn": metadata.version("scikit-learn"),
            "package": PACKAGE_VERSION,
            "git_commit": versions["git_commit"],
        },
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    return plain(coefficients)


def run_fit(models_path, activations_path, out_path, peaks_path=None, seed: int = SEED,
            resamples: int = BOOTSTRAP_RESAMPLES, configs_path=CONFIGS, comparison_path=None) -> dict:
    from pipeline.inputs.configs import read_config_records
    from pipeline.fit.formula import comparison_markdown
    from pipeline.core.io import write_text

    records = read_config_records(configs_path)
    models = read_table(models_path, "models")
    activations = read_table(activations_path, "activations")
    peaks = read_table(peaks_path, "peak-memory") if peaks_path else None
    inputs = {"models": models_path, "activations": activations_path}
    if peaks_path:
        inputs["peaks"] = peaks_path
    inputs["configs"] = configs_path
    coefficients = fit_coefficients(models, activations, peaks, seed, resamples, inputs, records)
    write_coefficients(coefficients, out_path)
    comparison_path = comparison_path or Path(out_path).with_name("formula_comparison.md")
    write_text(FORMULA_TABLE_HEADER + comparison_markdown(coefficients["activation_formula"]["comparison"])
               + PEAK_SECTION_POINTER, comparison_path)
    return coefficients


def add_cli(subparsers) -> None:
    from pipeline.core.arguments import non_negative_int, positive_int

    parser = subparsers.add_parser("fit", help="refit and cross-validate A = a*N + b; write coefficients.json")
    parser.add_argument("--models", default=MODELS)
    parser.add_argument("--activations", default=ACTIVATIONS)
    parser.add_argument("--peaks", default=None, help="peak_memory.parquet, for the estimator's empirical constants")
    parser.add_argument("--configs", default=CONFIGS, help="configs.json (the formula's config facts)")
    parser.add_argument("--out", default=COEFFICIENTS)
    parser.add_argument("--comparison", default=None,
                        help="markdown table formula vs baselines (default: formula_comparison.md beside --out)")
    parser.add_argument("--seed", type=non_negative_int, default=SEED)
    parser.add_argument("--resamples", type=positive_int, default=BOOTSTRAP_RESAMPLES)
    parser.set_defaults(handler=_fit_command)


def _fit_command(args) -> int:
    result = run_fit(args.models, args.activations, args.out, args.peaks, args.seed, args.resamples, args.configs,
                     args.comparison)
    print(summary_line(result) + f" -> {args.out}")
    return 0


def summary_line(c: dict) -> str:
    lofo = c["metrics"]["leave_one_family_out"] or {}
    lo, hi = c["intervals"]["a"]
    return (f"fit: A = {c['a']:.4e} * N + {c['b']:.4e} elements/token (a in [{lo:.3e}, {hi:.3e}]), "
            f"{c['n_models']} models, {c['n_families']} families, R^2 {c['metrics']['in_sample']['r2']:.3f}, "
            f"leave-one-family-out MAPE {lofo.get('mape', float('nan')):.1%}")
