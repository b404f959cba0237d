"""The closed-form formula: features and N from config facts, the fit's numbers, estimate without torch."""

import json
import math
import subprocess
import sys

import pandas as pd
import pytest

from pipeline.formulas.coefficients import check_coefficients, load_coefficients
from pipeline.inputs.configs import read_config_records
from pipeline.core.errors import UserError
from pipeline.estimate import estimate
from pipeline.formulas.features import feature_values, parameter_count, read_facts

RECORDS = read_config_records("results/configs.json")
MODELS = pd.read_parquet("results/models.parquet").set_index("model_id")
COEFFICIENTS = load_coefficients("results/coefficients.json")


def test_closed_form_parameters_match_the_counted_ones():
    errors = {m: parameter_count(read_facts(r["config"]))[0] / MODELS.loc[m, "parameters"] - 1
              for m, r in RECORDS.items() if r["status"] == "ok"}
    within = [m for m, e in errors.items() if abs(e) <= 1e-3]
    assert len(errors) == 230 and len(within) >= 229  # jetmoe (mixture of attention heads) is the exception
    assert errors["Qwen/Qwen2.5-1.5B"] == 0 and errors["meta-llama/Llama-3.1-8B"] == 0


def test_features_of_a_known_model():
    values = feature_values(read_facts(RECORDS["Qwen/Qwen2.5-1.5B"]["config"]), seq_len=512)
    assert values["hidden"] == 28 * 1536 and values["vocabulary"] == 151936
    assert values["attention"] == 28 * (12 + 2 * 2) * 128 and values["mlp_gated"] == 28 * 8960
    assert values["scores"] == 28 * 12 * 512


def test_unusual_config_says_what_it_could_not_read():
    facts = read_facts({"model_type": "mystery", "hidden_size": 512, "num_hidden_layers": 4, "vocab_size": 1000})
    assert any("heads" in u for u in facts.unread) and any("intermediate" in u for u in facts.unread)


def test_fit_numbers_from_the_committed_tables():
    section = COEFFICIENTS["activation_formula"]
    hook = section["hook_elements"]["metrics"]
    assert hook["in_sample"]["r2"] > 0.98 and hook["leave_one_family_out"]["r2"] > 0.95
    line = [r for r in section["comparison"] if r["formula"] == "A = a*N + b" and r["sample"] == "in sample"][0]
    assert line["r2"] < 0.3  # the blog's question: N alone does not explain the count
    assert section["parameters_closed_form"]["within_0.1%"] >= 186


def test_old_coefficient_file_gets_one_line_naming_the_version():
    with pytest.raises(UserError, match="schema_version 1 is not supported"):
        check_coefficients({**COEFFICIENTS, "schema_version": 1})


def test_every_registry_config_gets_a_finite_positive_answer(tmp_path):
    for model_id, record in RECORDS.items():
        answer = estimate(config=record["config"], batch=2, seq=512, precision="bf16", method="formula",
                          coefficients=COEFFICIENTS)
        assert math.isfinite(answer["peak_bytes"]) and answer["peak_bytes"] > 0, model_id


def test_formula_needs_neither_torch_nor_transformers(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(RECORDS["meta-llama/Llama-3.2-1B"]["config"]))
    code = ("import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"
            "from pipeline.estimate import estimate, max_batch_size\n"
            f"r = estimate(config={str(path)!r}, batch=4, seq=1024, precision='amp-bf16', method='formula')\n"
            f"b = max_batch_size(config={str(path)!r}, seq=1024, precision='bf16', gpu_memory_gib=80, method='formula')\n"
            "print(r['peak_bytes'], r['unread_terms'], b)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert float(out[0]) > 0 and out[1] == "[]" and int(out[-1]) > 0


def test_kernel_rule_and_amp_copies_from_config_facts():
    from pipeline.formulas.features import attention_kernel, matmul_parameters

    qwen = read_facts(RECORDS["Qwen/Qwen2.5-1.5B"]["config"])  # GQA, no window
    assert attention_kernel(qwen, "fp32") == "math" and attention_kernel(qwen, "bf16") == "fused"
    assert attention_kernel(read_facts(RECORDS["bigscience/bloom-560m"]["config"]), "bf16") == "eager"
    # tied: every weight but the norms is a matmul weight (the head reuses the embedding)
    assert matmul_parameters(qwen) == parameter_count(qwen)[0] - 1536 * (1 + 2 * 28)


def test_peak_is_the_larger_branch_and_meets_the_goal_out_of_sample():
    from pipeline.formulas.peak import closed_form_peak

    facts = read_facts(RECORDS["Qwen/Qwen2.5-1.5B"]["config"])
    peaks = COEFFICIENTS["activation_formula"]["peak"]
    small = closed_form_peak(peaks, facts, 1543714304, 1, 128, "bf16", "adamw", False)
    large = closed_form_peak(peaks, facts, 1543714304, 8, 4096, "bf16", "adamw", False)
    assert small["peak_phase"] == "optimizer" and large["peak_phase"] == "backward"
    assert small["peak_bytes"] == 1543714304 * 2 * 5 + (65 << 20)
    summary = json.load(open("results/validation_summary.json"))
    text = json.dumps(summary)
    assert "formula-lofo" in text


def test_features_subset_documents_every_column():
    from pipeline.publish.dataset.columns import undocumented_columns
    from pipeline.formulas.features import feature_rows

    frame = pd.DataFrame(feature_rows(RECORDS))
    assert len(frame) == 230 and undocumented_columns({"features": frame}) == []
    row = frame.set_index("model_id").loc["openai-community/gpt2"]
    assert row["feature_dropout"] == 25 * 768 and row["feature_mlp_composite"] == 12 * 3072


def test_hook_features_per_op_from_the_module_counts():
    from pipeline.formulas.hook_features import hook_feature_values

    def values(model_id):
        record = RECORDS[model_id]
        return hook_feature_values(read_facts(record["config"]))

    # Per-module meta counts (`python -m pipeline count`): Mixtral's activation module 32 x 2 x 14336,
    # gpt-oss none (a function inside the experts), Llama 4 Scout every expert (16 + its outputs 16 x 5120),
    # Qwen 3 MoE's query/key norms 48 x (32 + 4) x 128.
    assert values("mistralai/Mixtral-8x7B-v0.1")["expert_activations"] == 917504
    assert values("openai/gpt-oss-20b")["expert_activations"] == 0
    assert values("meta-llama/Llama-4-Scout-17B-16E")["expert_outputs"] == 3932160
    assert values("Qwen/Qwen3-30B-A3B")["qk_norm"] == 48 * 36 * 128
    hook = COEFFICIENTS["activation_formula"]["hook_elements"]
    assert hook["metrics"]["leave_one_family_out"]["r2"] >= 0.98  # the goal (0.957 before the per-op terms)
    assert 0.9 < hook["coefficients"]["expert_activations"] < 1.1  # one output per element: physics, not tuning


def test_formula_figures_and_peak_rows_from_the_committed_tables(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from pipeline.publish.figures import draw_formula_vs_counted, formula_points, relative_errors
    from pipeline.validate.peaks import peak_comparison_markdown, write_peak_comparison

    points = formula_points(__import__("pathlib").Path("results"))
    assert len(points) == 230 and points["family"].nunique() == 82
    assert relative_errors(points, "formula_lofo").abs().median() < 0.05
    assert relative_errors(points, "line_lofo").abs().median() > 0.3
    figure = draw_formula_vs_counted(__import__("pathlib").Path("results"))
    scatters = [c for ax in figure.axes for c in ax.collections if type(c).__name__ == "PathCollection"]
    held_out = int(points["held_out"].sum())  # circled again in each panel (fit.formula.HELD_OUT_MODELS)
    assert held_out == 12 and sum(len(c.get_offsets()) for c in scatters) == 3 * (230 + held_out)  # every model
    summary = json.loads(open("results/validation_summary.json").read())
    table = peak_comparison_markdown(summary)
    assert "| closed form | leave one family out | 2505 | 0.6% | 6.5% | 28.0% | 99.9% |" in table
    path = tmp_path / "peak_comparison.md"
    write_peak_comparison(summary, path)
    assert path.read_text().startswith("# Peak of the standard training step") and table in path.read_text()


def test_features_subset_lets_others_refit_the_hook_count():
    """The dataset's features subset carries every term of the hook formula: the committed
    coefficients times the subset's columns give the formula's own hook prediction."""
    from pipeline.publish.dataset.subsets import features_table
    from pipeline.formulas.hook_features import HOOK_TERMS

    rows = {row["model_id"]: row for row in features_table("results/configs.json")}
    assert len(rows) == 230
    mixtral = rows["mistralai/Mixtral-8x7B-v0.1"]
    assert mixtral["feature_expert_activations"] == 917504 and mixtral["feature_qk_norm"] == 0
    coefficients = json.loads(open("results/coefficients.json").read())["activation_formula"]
    hook = coefficients["hook_elements"]["coefficients"]
    predictions = {row["model_id"]: row for row in coefficients["hook_predictions"]}
    # LFM2 and Falcon-H1: the convolution's hook term (kernel positions per token), not the saved-bytes one
    assert rows["LiquidAI/LFM2-350M"]["feature_mixer_conv_outputs"] == 3 * rows["LiquidAI/LFM2-350M"]["feature_mixer_conv"]
    for model_id in ("mistralai/Mixtral-8x7B-v0.1", "Qwen/Qwen2.5-1.5B", "openai/gpt-oss-20b", "LiquidAI/LFM2-350M",
                     "tiiuae/Falcon-H1-0.5B-Instruct"):
        refit = sum(hook.get(term, 0.0) * rows[model_id][f"feature_{term}"] for term in HOOK_TERMS)
        assert refit == pytest.approx(predictions[model_id]["formula"], rel=1e-9)


def test_formula_answers_amp_fp16_with_amp_bf16_tensors():
    """amp-fp16 keeps amp-bf16's tensors (2-byte copies and activations): the same closed form,
    checked against the H100's loop amp-fp16 points it was never fitted on (within 5%)."""
    records = read_config_records("results/configs.json")
    config = records["HuggingFaceTB/SmolLM2-135M"]["config"]
    run = dict(config=config, batch=4, seq=512, method="formula", coefficients="results/coefficients.json")
    assert estimate(precision="amp-fp16", **run)["peak_bytes"] == estimate(precision="amp-bf16", **run)["peak_bytes"]
    # the loop's rows of the first H100 sweep (the Trainer's inflation did not touch the loop client)
    measured = pd.read_parquet("results/trainer/provisional/h100/peak_memory.parquet")
    loop = measured[(measured.client == "loop") & (measured.status == "ok")]
    assert len(loop) >= 20
    for row in loop.itertuples():
        answer = estimate(config=records[row.model_id]["config"], batch=int(row.batch_size), seq=int(row.seq_len),
                          precision="amp-fp16", method="formula", coefficients="results/coefficients.json")
        assert abs(answer["peak_bytes"] / row.peak_allocated_bytes - 1) < 0.05, row.model_id
