"""Fit the closed-form activation formula (`pipeline.formulas.features`) on the committed tables.

Three linear regressions without intercept, non-negative coefficients (scikit-learn
LinearRegression(positive=True)), least squares of the relative error (weights 1/y^2):

- `hook_elements`: hook-method elements per token at (B, L) = (1, 1) = sum_k c_k x_k;
- `saved_bytes[precision]`: saved-for-backward bytes per token at every measured (B, L) =
  sum_k c_k x_k(L) + c_N x N / (B L) (the last term: weight copies autocast keeps, once per step);
- `peak[precision(+checkpointing)]`: the saved bytes of the standard step's peak, a max of two
  closed-form branches (`pipeline.formulas.peak` says which terms are exact and which are fitted).

Each fit reports in-sample and leave-one-family-out R^2, MAPE, worst, and bootstrap intervals.
`comparison` puts the formula beside A = a N + b, the blog's line and Korthikanti et al.

`HELD_OUT_MODELS` never enter these fits: models of the 2025-26 architectures kept apart, whose
counted hook elements and saved bytes the fitted formula is judged on afterwards (`held_out`), as the
GPU plans `config/sweep_new_arch_heldout.yaml` and `config/sweep_norms_heldout.yaml` keep their peaks apart.
"""

from __future__ import annotations

from pipeline.formulas.features import FEATURES, feature_values, korthikanti_bytes_per_token, parameter_count, read_facts
from pipeline.fit.peak import fit_peak, peak_table
from pipeline.formulas.peak import PEAK_FORMULA
from pipeline.formulas.hook_features import HOOK_FEATURES, HOOK_TERMS, hook_feature_values
from pipeline.fit.regression import SEED, fit_terms, metrics, public
from pipeline.formulas.components import BLOG_A_BYTES_PER_ELEMENT, blog_a_bytes
from pipeline.core.vocabulary import ACTIVATION_BYTES, PRECISION_OF_DTYPE

TERMS = list(FEATURES)
# Kept out of every formula fit and judged apart (one per family: gated delta-net, short convolutions,
# Mamba-2 with a shared MLP, a parallel Mamba-2 hybrid, per-layer inputs with two attention widths, relu-squared).
HELD_OUT_MODELS = ("Qwen/Qwen3.5-2B", "LiquidAI/LFM2-1.2B", "ibm-granite/granite-4.0-h-1b", "tiiuae/Falcon-H1-3B-Instruct",
                   "google/gemma-4-E2B-it", "karpathy/nanochat-d32",
                   # config/sweep_norms_heldout.yaml: measured after the query/key-norm and soft-cap terms
                   "Qwen/Qwen3-4B-Instruct-2507", "LiquidAI/LFM2-2.6B", "tencent/Hunyuan-4B-Instruct", "Qwen/Qwen3.5-4B",
                   "google/gemma-2-9b", "allenai/OLMo-2-1124-7B")
FORMULA_RESAMPLES = 200  # bootstrap draws of each formula fit (each a non-negative least squares)
N_TERM = "weights"  # the coefficient of N: bytes per parameter kept beside the activations


def model_features(records: dict) -> dict:
    """{model id: Facts} from configs.json records (status ok)."""
    return {model_id: read_facts(r["config"]) for model_id, r in records.items() if r.get("status") == "ok"}


def split_held_out(facts: dict) -> tuple[dict, dict]:
    """(the models the formula is fitted on, the held-out ones), as {model id: Facts}."""
    return ({m: f for m, f in facts.items() if m not in HELD_OUT_MODELS},
            {m: f for m, f in facts.items() if m in HELD_OUT_MODELS})


def design(facts, seq_len: int, terms) -> list:
    values = feature_values(facts, seq_len)
    return [values[t] for t in terms]


# ----------------------------------------------------------------------------- the three quantities


def hook_table(models, activations, facts):
    hooks = activations[(activations["method"] == "hook") & (activations["status"] == "ok")
                        & (activations["batch_size"] == 1) & (activations["seq_len"] == 1)
                        & (activations["dtype"] == "float32")]
    ok = models[models["status"] == "ok"][["model_id", "family", "parameters", "active_parameters"]]
    rows = ok.merge(hooks[["model_id", "elements_per_token"]], on="model_id")
    return rows[rows["model_id"].isin(facts)].sort_values("model_id").reset_index(drop=True)


def hook_design(facts: dict) -> dict:
    """{model id: the hook count's features (`pipeline.formulas.hook_features`)} of the ok models."""
    return {m: list(hook_feature_values(f).values()) for m, f in facts.items()}


def fit_hook_formula(rows, hook_x: dict, **run) -> dict:
    x = [hook_x[m] for m in rows["model_id"]]
    fit = fit_terms(x, rows["elements_per_token"], rows["family"], rows["model_id"], HOOK_TERMS, **run)
    fit["units"] = {"y": "activation elements per token (hook method, B=1, L=1)", "c": "elements per feature unit"}
    fit["formula"] = "A = " + " + ".join(f"c_{t} x {t}" for t in HOOK_TERMS)
    return fit


def saved_table(models, activations, facts, precision: str):
    saved = activations[(activations["method"] == "saved") & (activations["status"] == "ok")]
    saved = saved[saved["dtype"].map(PRECISION_OF_DTYPE) == precision]
    ok = models[models["status"] == "ok"][["model_id", "family", "parameters"]]
    rows = ok.merge(saved[["model_id", "batch_size", "seq_len", "bytes_per_token"]], on="model_id")
    return rows[rows["model_id"].isin(facts)].sort_values(["model_id", "seq_len", "batch_size"]).reset_index(drop=True)


def fit_saved_formula(rows, facts, precision: str, **run) -> dict:
    terms = TERMS + [N_TERM]
    x = [design(facts[r.model_id], int(r.seq_len), TERMS) + [r.parameters / (r.batch_size * r.seq_len)]
         for r in rows.itertuples()]
    fit = fit_terms(x, rows["bytes_per_token"], rows["family"], rows["model_id"], terms, **run)
    fit["units"] = {"y": f"bytes saved for backward per token ({precision})", "c": "bytes per feature unit"}
    fit["formula"] = "S(B, L) = " + " + ".join(f"c_{t} x {t}" for t in TERMS) + " + c_weights x N / (B x L)"
    return fit


# ----------------------------------------------------------------------------- comparison


def comparison(hook_rows, hook_fit, line, saved_fits: dict, saved_rows: dict, facts) -> list:
    """Rows (quantity, formula, sample, R^2, MAPE, worst) for the formula and the baselines."""
    import numpy as np

    out = []
    y = hook_rows["elements_per_token"].to_numpy(float)
    ids = hook_rows["model_id"].to_numpy()
    n = hook_rows["parameters"].to_numpy(float)
    korthikanti = np.array([korthikanti_bytes_per_token(facts[m], 1) / 2 for m in ids])  # 16-bit bytes -> elements
    out += [_row("hook elements per token (B=L=1)", "formula", "in sample", y, hook_fit["predicted"], ids),
            _row("hook elements per token (B=L=1)", "formula", "leave one family out", y, hook_fit["predicted_lofo"], ids),
            _row("hook elements per token (B=L=1)", "A = a*N + b", "in sample", y, line["predicted"], ids),
            _row("hook elements per token (B=L=1)", "A = a*N + b", "leave one family out", y, line["predicted_lofo"], ids),
            _row("hook elements per token (B=L=1)", "blog (published a, b)", "not fitted", y,
                 blog_a_bytes(n) / BLOG_A_BYTES_PER_ELEMENT, ids),
            _row("hook elements per token (B=L=1)", "Korthikanti 34h per layer (16-bit bytes / 2)", "not fitted", y,
                 korthikanti, ids)]
    for precision, fit in saved_fits.items():
        rows = saved_rows[precision]
        y = rows["bytes_per_token"].to_numpy(float)
        ids = rows["model_id"].to_numpy()
        quantity = f"saved bytes per token, {precision}, all (B, L)"
        korthikanti = np.array([korthikanti_bytes_per_token(facts[r.model_id], int(r.seq_len))
                                * ACTIVATION_BYTES[precision] / 2 for r in rows.itertuples()])
        out += [_row(quantity, "formula", "in sample", y, fit["predicted"], ids),
                _row(quantity, "formula", "leave one family out", y, fit["predicted_lofo"], ids),
                _row(quantity, "Korthikanti 34sbh + 5as^2b (scaled to the precision)", "not fitted", y, korthikanti, ids)]
    return out


def _row(quantity, formula, sample, y, predicted, ids) -> dict:
    return {"quantity": quantity, "formula": formula, "sample": sample, **metrics(y, predicted, ids)}


def line_in_formula_cv(rows, **run) -> dict:
    """A = a*N + b (N active parameters, relative error) in the same CV, for the comparison."""
    import numpy as np

    n = rows["active_parameters"].fillna(rows["parameters"]).to_numpy(float)
    x = np.column_stack([n, np.ones_like(n)])
    return fit_terms(x, rows["elements_per_token"], rows["family"], rows["model_id"], ["a", "b"], **run)


def hook_predictions(rows, hook_fit, line) -> list:
    """Per model: the counted hook elements per token and what each formula predicts (the figures' points)."""
    n = rows["parameters"].to_numpy(float)
    return [{"model_id": m, "family": f, "counted": float(y), "formula": float(p), "formula_lofo": float(q),
             "line": float(a), "line_lofo": float(b), "blog": float(blog_a_bytes(k) / BLOG_A_BYTES_PER_ELEMENT)}
            for m, f, y, p, q, a, b, k in zip(rows["model_id"], rows["family"], rows["elements_per_token"],
                                              hook_fit["predicted"], hook_fit["predicted_lofo"], line["predicted"],
                                              line["predicted_lofo"], n)]


def comparison_markdown(rows: list) -> str:
    lines = ["| quantity | formula | sample | points | R^2 | MAPE | median | worst (model) |", "|---|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['quantity']} | {r['formula']} | {r['sample']} | {r['n']} | {r['r2']:.3f} | {r['mape']:.1%} | "
                     f"{r['median_ape']:.1%} | {r['max_abs_percentage_error']:.0%} ({r['worst_model_id']}) |")
    return "\n".join(lines) + "\n"


def saved_coefficients(saved: dict) -> dict:
    """{precision: {term: bytes per element}} of the counted saved bytes' fits (the peak fit's fallback for
    terms no measured model has)."""
    return {precision: fit["coefficients"] for precision, fit in saved.items()}


def held_out_check(models, activations, records, held: dict, hook_fit, saved_fits, line) -> dict:
    """The fitted formula on the held-out models (`HELD_OUT_MODELS`): its hook elements at (1, 1) and its saved
    bytes per token at every counted point and precision, against the counts; metrics as every fit reports
    them, and the hook predictions for the figures (flagged held_out)."""
    import numpy as np

    section = {"models": sorted(held), "hook_predictions": []}
    if not held:
        return section
    hooks = hook_table(models, activations, held)
    if hooks.empty:
        return section
    x = hook_design(held)
    predicted = [sum(c * v for c, v in zip(hook_fit["coefficients"].values(), x[m])) for m in hooks["model_id"]]
    section["hook_elements"] = metrics(hooks["elements_per_token"], predicted, hooks["model_id"])
    a, b = line["coefficients"]["a"], line["coefficients"]["b"]
    active = hooks["active_parameters"].fillna(hooks["parameters"])
    section["hook_predictions"] = [{"model_id": m, "family": f, "counted": float(y), "formula": float(p),
                                    "formula_lofo": float(p), "line": float(a * n + b), "line_lofo": float(a * n + b),
                                    "blog": float(blog_a_bytes(k) / BLOG_A_BYTES_PER_ELEMENT), "held_out": True}
                                   for m, f, y, p, n, k in zip(hooks["model_id"], hooks["family"],
                                                               hooks["elements_per_token"], predicted, active,
                                                               hooks["parameters"])]
    section["saved_bytes"] = {}
    for precision, fit in saved_fits.items():
        rows = saved_table(models, activations, held, precision)
        if not len(rows):
            continue
        coefficients = fit["coefficients"]
        predicted = [sum(coefficients[t] * v for t, v in zip(TERMS, design(held[r.model_id], int(r.seq_len), TERMS)))
                     + coefficients[N_TERM] * r.parameters / (r.batch_size * r.seq_len) for r in rows.itertuples()]
        result = metrics(rows["bytes_per_token"], predicted, rows["model_id"])
        relative = np.abs(np.asarray(predicted) / rows["bytes_per_token"].to_numpy(float) - 1)
        result["p90_ape"] = float(np.percentile(relative, 90))
        section["saved_bytes"][precision] = result
    return section


def parameter_check(models, facts) -> dict:
    """Closed-form N against the counted N of every model."""
    import numpy as np

    ok = models[(models["status"] == "ok") & models["model_id"].isin(facts)]
    errors = np.array([parameter_count(facts[m])[0] / n - 1 for m, n in zip(ok["model_id"], ok["parameters"])])
    worst = int(np.argmax(np.abs(errors)))
    return {"models": int(len(errors)), "median_abs_relative_error": float(np.median(np.abs(errors))),
            "within_0.1%": int((np.abs(errors) <= 1e-3).sum()), "worst_relative_error": float(errors[worst]),
            "worst_model_id": str(ok["model_id"].iloc[worst])}


def fit_formula(models, activations, peaks, records: dict, resamples: int = FORMULA_RESAMPLES, seed: int = SEED) -> tuple:
    """(the coefficient file's `activation_formula` section, the comparison markdown)."""
    from pipeline.formulas.features import KERNELS
    from pipeline.inputs.aliases import FIELDS
    from pipeline.core.vocabulary import PRECISIONS

    every = model_features(records)
    facts, held = split_held_out(every)
    run = {"resamples": resamples, "seed": seed}
    hooks = hook_table(models, activations, facts)
    hook = fit_hook_formula(hooks, hook_design(facts), **run)
    saved_rows = {p: saved_table(models, activations, facts, p) for p in PRECISIONS}
    saved = {p: fit_saved_formula(rows, facts, p, **run) for p, rows in saved_rows.items() if len(rows)}
    line = line_in_formula_cv(hooks, **run)
    table = comparison(hooks, hook, line, saved, saved_rows, facts)
    held_out = held_out_check(models, activations, records, held, hook, saved, line)
    section = {
        "features": dict(FEATURES),
        "hook_features": dict(HOOK_FEATURES),
        "config_fields": {fact: list(names) for fact, names in FIELDS.items()},
        "feature_units": "elements per token (scores: per token at sequence length L)",
        "hook_elements": public(hook),
        "saved_bytes": {p: public(f) for p, f in saved.items()},
        "peak_formula": PEAK_FORMULA,
        "attention_kernels": dict(KERNELS),
        "peak": fit_peak(peak_table(peaks, facts), facts, counted=saved_coefficients(saved), **run)
        if peaks is not None else {},
        "parameters_closed_form": parameter_check(models, every),
        "held_out": held_out,
        "korthikanti": "per layer 34*s*b*h + 5*a*s^2*b bytes (16-bit; Korthikanti et al. 2022)",
        "comparison": table,
        "hook_predictions": hook_predictions(hooks, hook, line) + held_out.pop("hook_predictions"),
    }
    return section, comparison_markdown(table)
