"""The estimators: the blog's formula as published, the heuristic in consistent units, fits and max batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pipeline.cli import main
from pipeline.formulas.coefficients import load_coefficients
from pipeline.core.errors import UserError
from pipeline.estimate import GIB, estimate, max_batch_size
from pipeline.fit.stage import run_fit
from conftest import SMALL_REGISTRY as REGISTRY
from conftest import offline_env

QWEN_1_5B_PARAMETERS = 1_543_714_304


@pytest.fixture(scope="module")
def coefficients(tables, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("estimate") / "coefficients.json"
    run_fit(*tables, path, resamples=100)
    return path


@pytest.fixture(scope="module")
def qwen_config(tmp_path_factory) -> Path:
    """Qwen2.5-1.5B's config.json facts, as the test registry holds them."""
    entries = {e["id"]: e for e in yaml.safe_load(REGISTRY.read_text())["models"]}
    path = tmp_path_factory.mktemp("config") / "config.json"
    path.write_text(json.dumps(entries["Qwen/Qwen2.5-1.5B"]["config"]))
    return path


def test_blog_method_reproduces_the_published_formula(qwen_config):
    result = estimate(config=qwen_config, batch=16, seq=256, precision="fp32", method="blog")
    n = 1_543_714_304
    assert result["parameters"] == n  # counted from the config on the meta device
    a = 4.6894e-4 * n + 1.8494e6  # the blog's A: fp32 bytes per token
    p = 4
    expected = n * p + 2 * n * p + max(n * p + n * p, a * 16 * 256 * p)
    assert result["peak_bytes"] == pytest.approx(expected, rel=1e-12)
    assert result["components"]["activations"] == pytest.approx(a * 16 * 256 * p)
    assert result["activations_per_token"] == pytest.approx(a)
    assert any("4x" in note for note in result["notes"])


def test_heuristic_uses_consistent_units(coefficients):
    c = load_coefficients(coefficients)
    n = QWEN_1_5B_PARAMETERS
    for precision, weight, element in (("fp32", 4, 4), ("bf16", 2, 2), ("amp-bf16", 4, 2)):
        result = estimate(params=n, batch=8, seq=128, precision=precision, coefficients=coefficients)
        elements = c["a"] * n + c["b"]
        multiplier = c["estimator"]["activation_multiplier"][precision]["value"]
        parts = result["components"]
        assert result["activations_per_token"] == pytest.approx(elements)
        copies = 2 * n if precision == "amp-bf16" else 0  # bf16 weight copies autocast keeps for backward
        assert parts["activations"] == pytest.approx(elements * 8 * 128 * element * multiplier + copies)
        assert parts["parameters"] == parts["gradients"] == parts["optimizer_intermediates"] == n * weight
        assert parts["optimizer_state"] == 2 * n * weight
        # gradients count in both branches: the backward peak holds them beside the activations
        assert result["peak_bytes"] == pytest.approx(
            parts["parameters"] + parts["optimizer_state"] + parts["gradients"]
            + max(parts["optimizer_intermediates"], parts["activations"]))
    sgd = estimate(params=n, batch=8, seq=128, precision="fp32", optimizer="sgd", coefficients=coefficients)
    assert sgd["components"]["optimizer_state"] == n * 4  # one momentum buffer
    assert sgd["components"]["optimizer_intermediates"] == 0


def test_heuristic_takes_active_parameters_of_a_moe_config(coefficients, tmp_path):
    entries = {e["id"]: e for e in yaml.safe_load(REGISTRY.read_text())["models"]}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(entries["Qwen/Qwen1.5-MoE-A2.7B"]["config"]))
    c = load_coefficients(coefficients)
    result = estimate(config=path, batch=1, seq=64, precision="bf16", coefficients=coefficients)
    assert result["active_parameters"] < result["parameters"]
    assert result["activations_per_token"] == pytest.approx(c["a"] * result["active_parameters"] + c["b"])
    assert result["components"]["parameters"] == 2 * result["parameters"]
    given = estimate(params=result["parameters"], active_params=result["active_parameters"], batch=1, seq=64,
                     precision="bf16", coefficients=coefficients)
    assert given["peak_bytes"] == pytest.approx(result["peak_bytes"])


def test_gpu_memory_answer_and_max_batch_size(coefficients):
    kwargs = dict(params=QWEN_1_5B_PARAMETERS, seq=256, precision="fp32", method="blog")
    result = estimate(batch=16, gpu_memory_gib=80, **kwargs)
    need = result["peak_reserved_bytes"] + result["outside_bytes"]  # the verdict: reserved + outside PyTorch
    assert result["peak_reserved_bytes"] > result["peak_bytes"]
    assert result["fits"] is (need <= 80 * GIB) and result["headroom_bytes"] == pytest.approx(80 * GIB - need)
    assert estimate(batch=16, gpu_memory_gib=need / GIB * 0.99, **kwargs)["fits"] is False
    for method in ("blog", "heuristic"):
        kwargs["method"] = method
        sizes = [max_batch_size(gpu_memory_gib=m, coefficients=coefficients, **kwargs) for m in (16, 24, 40, 80, 141)]
        assert sizes == sorted(sizes) and sizes[0] == 0 and sizes[-1] > 0
        largest = sizes[-1]
        assert estimate(batch=largest, gpu_memory_gib=141, coefficients=coefficients, **kwargs)["fits"]
        assert not estimate(batch=largest + 1, gpu_memory_gib=141, coefficients=coefficients, **kwargs)["fits"]


def test_params_only_cli(capsys, coefficients):
    assert main(["estimate", "--params", "1543714304", "--batch", "16", "--seq", "256", "--precision", "bf16",
                 "--coefficients", str(coefficients), "--gpu-memory", "80", "--max-batch-size", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["method"] == "heuristic" and result["parameters"] == QWEN_1_5B_PARAMETERS
    assert set(result["components"]) == {"parameters", "gradients", "optimizer_state", "optimizer_intermediates",
                                         "activations"}
    assert result["fits"] is True and result["max_batch_size"] >= 16


@pytest.mark.parametrize("arguments", [
    ["--params", "1e9", "--batch", "0", "--seq", "8", "--precision", "fp32"],
    ["--params", "1e9", "--batch", "1", "--seq", "-3", "--precision", "fp32"],
    ["--params", "1e9", "--batch", "1", "--seq", "8", "--precision", "fp16"],
    ["--params", "1e9", "--batch", "1", "--seq", "8", "--precision", "fp32", "--method", "exact"],
    ["--params", "-5", "--batch", "1", "--seq", "8", "--precision", "fp32", "--method", "blog"],
    ["--params", "1e9", "--batch", "1", "--seq", "8", "--precision", "fp32", "--coefficients", "{bad}"],
    ["--params", "1e9", "--batch", "1", "--seq", "8", "--precision", "fp32", "--coefficients", "{missing}"],
    ["--config", "{no_heads}", "--batch", "1", "--seq", "8", "--precision", "fp32", "--method", "blog"],
    ["--params", "1e9", "--seq", "8", "--precision", "fp32", "--method", "blog", "--max-batch-size"],
])
def test_bad_input_is_one_line_and_exit_2(arguments, tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema_version": 1, "a": ')  # a truncated coefficient file
    no_heads = tmp_path / "config.json"
    no_heads.write_text(json.dumps({"model_type": "qwen2", "vocab_size": 1000, "hidden_size": 64,
                                    "num_hidden_layers": 2}))
    paths = {"{bad}": str(bad), "{missing}": str(tmp_path / "absent.json"), "{no_heads}": str(no_heads)}
    arguments = [paths.get(a, a) for a in arguments]
    try:
        code = main(["estimate", *arguments])
    except SystemExit as exc:  # argparse's own one-line errors
        code = exc.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and err and "\n" not in err and "Traceback" not in err


def test_python_api_bad_input():
    with pytest.raises(UserError, match="batch must be a positive integer"):
        estimate(params=1e9, batch=0, seq=8, precision="fp32", method="blog")
    with pytest.raises(UserError, match="exactly one of"):
        estimate(params=1e9, config={"model_type": "gpt2"}, batch=1, seq=8, precision="fp32", method="blog")


def test_one_estimator_per_method_and_a_checked_run():
    from dataclasses import FrozenInstanceError

    from pipeline.estimate import ESTIMATORS, Run
    from pipeline.core.vocabulary import METHODS

    assert tuple(ESTIMATORS) == METHODS and all(ESTIMATORS[m].name == m for m in METHODS)
    run = Run(2, 8, "bf16", checkpointing=True)
    assert run.checkpointing is True and run.with_batch(5).batch == 5 and run.batch == 2
    with pytest.raises(FrozenInstanceError):
        run.batch = 3
    for bad, message in ((dict(batch=0), "batch must be a positive integer"), (dict(seq=True), "seq must be"),
                         (dict(precision="fp16"), "precision 'fp16' is not one of"),
                         (dict(optimizer="adam"), "optimizer 'adam' is not one of"),
                         (dict(checkpointing=1), "checkpointing must be true or false, not 1")):
        with pytest.raises(UserError, match=message):
            Run(**{"batch": 1, "seq": 8, "precision": "fp32", **bad})


class _Linear:
    """A peak of 10 + 3 B bytes, with an optional (possibly wrong) guess of the largest batch."""

    name = "linear"

    def __init__(self, guess=None):
        self.guess, self.calls = guess, 0

    def predict(self, target, run):
        from pipeline.estimate import Estimate

        self.calls += 1
        return Estimate(10 + 3 * run.batch, None)

    def guess_batch(self, target, run, memory_bytes):
        return self.guess


@pytest.mark.parametrize("guess", [None, 1, 2, 29, 30, 31, 1000])
def test_largest_batch_is_one_search_for_every_estimator(guess):
    """`largest` is the search of max_batch_size and max_seq_len (on the fit verdict); here on a plain budget."""
    from pipeline.estimate import Run, Target, largest

    from pipeline.core.vocabulary import MAX_BATCH

    run, target = Run(1, 8, "fp32"), Target(1)

    def search(estimator, memory, limit=MAX_BATCH, exact_limit=True):
        def fit(batch):
            return estimator.predict(target, run.with_batch(batch)).peak_bytes <= memory
        return largest(fit, limit, estimator.guess_batch(target, run, memory), exact_limit)

    for memory, expected in ((12, 0), (13, 1), (99, 29), (100, 30), (3 * 2**19 + 10, 2**19), (10**12, MAX_BATCH)):
        assert search(_Linear(guess), memory) == expected
    # without an exact limit, the doubling stops past the limit (or past twice a checked guess)
    assert search(_Linear(guess), 10**12, limit=64, exact_limit=False) >= 64
    assert search(_Linear(), 10**12, limit=64, exact_limit=False) == 127
    assert largest(lambda n: n <= 1000, 64, None, exact_limit=True) == 64  # max_seq_len: never past the limit
    assert largest(lambda n: n <= 50, 64, None, exact_limit=True) == 50


def test_formulas_and_coefficients_import_nothing_heavy():
    import subprocess
    import sys

    code = ("import sys, pipeline.formulas.components, pipeline.formulas.coefficients; "
            "print(sorted({'torch', 'transformers', 'numpy', 'pandas', 'sklearn'} & set(sys.modules)))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"


UNUSED_BY_AN_EXACT_ANSWER = {"sklearn", "scipy", "pandas", "pyarrow", "matplotlib", "trl", "peft", "datasets"}


def test_the_exact_command_imports_only_what_its_question_needs():
    """A cold exact answer for a registry model (issue 26) imports torch and transformers' modelling code, and none
    of the libraries it does not use: scikit-learn and scipy (which transformers imports wherever they are
    installed), the tables', the figures' and the trainers' libraries."""
    import subprocess
    import sys

    argv = ["python -m pipeline", "estimate", "--model", "Qwen/Qwen2.5-0.5B", "--batch", "1", "--seq", "64",
            "--precision", "bf16", "--method", "exact", "--json"]
    looked_for = sorted(UNUSED_BY_AN_EXACT_ANSWER | {"torch", "transformers"})
    code = (f"import runpy, sys\nsys.argv = {argv!r}\ntry:\n    runpy.run_module('pipeline', run_name='__main__', "
            "alter_sys=True)\nexcept SystemExit:\n    pass\ntops = {m.split('.')[0] for m in sys.modules}\n"
            f"print(sorted(tops & set({looked_for!r})), file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=offline_env(), timeout=300)
    assert json.loads(done.stdout)["method"] == "exact"
    assert done.stderr.strip().splitlines()[-1] == "['torch', 'transformers']"


def test_config_shape_check_is_the_registry_one(coefficients, tmp_path, capsys):
    """An attention-free model's config.json (mamba: no attention heads) is estimated; a config
    without a shape fact its class has is one line, exit 2."""
    from pipeline.inputs.configs import config_from_dict
    from pipeline.inputs.modeling import build_model

    entries = {e["id"]: e for e in yaml.safe_load(Path("models.yaml").read_text())["models"]}
    facts = next(e["config"] for e in entries.values() if e["config"].get("model_type") == "mamba")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(facts))
    assert main(["estimate", "--config", str(path), "--batch", "1", "--seq", "128", "--precision", "bf16",
                 "--method", "heuristic", "--coefficients", str(coefficients), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    n = sum(p.numel() for p in build_model(config_from_dict(facts), "meta").parameters())
    assert 100e6 < n < 200e6 and result["parameters"] == n
    parts = result["components"]
    assert parts["parameters"] == parts["gradients"] == 2 * n and parts["optimizer_state"] == 4 * n
    assert result["peak_bytes"] == pytest.approx(
        8 * n + max(parts["optimizer_intermediates"], parts["activations"]))
    del facts["hidden_size"]
    path.write_text(json.dumps(facts))
    assert main(["estimate", "--config", str(path), "--batch", "1", "--seq", "128", "--precision", "bf16",
                 "--method", "heuristic", "--coefficients", str(coefficients)]) == 2
    assert capsys.readouterr().err == f"error: {path}: field 'hidden_size': missing\n"
