"""Tests of the training-step memory simulator (pipeline.simulate).

The live-byte tracker must agree exactly with a real training step run on the CPU with real
weights (same tracker, same rules): every number compared below comes from two real runs of
the same tiny models, one on the CPU and one on the meta device. What differs on CUDA (kernel
choice, autocast) is checked against the rules' own definitions and, once the GPU sweep's table
is committed, against measured H200 peaks.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TINY_GPT2, TINY_LLAMA
import yaml

from pipeline.core.errors import UserError
from pipeline.training.values import Run

REPO = Path(__file__).resolve().parent.parent
SMALL_REGISTRY = REPO / "tests" / "data" / "models_small.yaml"
PEAKS = REPO / "results" / "peak_memory.parquet"


def small_facts(model_id: str) -> dict:
    models = {m["id"]: m for m in yaml.safe_load(SMALL_REGISTRY.read_text())["models"]}
    return dict(models[model_id]["config"])


def run_step(facts: dict, device: str, precision: str, attn: str = "eager", **setting) -> dict:
    import torch

    from pipeline.inputs.configs import config_from_dict
    from pipeline.inputs.modeling import build
    from pipeline.simulate.step import simulate_training_step

    torch.manual_seed(0)
    model = build(config_from_dict(facts), precision, attn, device=device)
    return simulate_training_step(model, 2, 24, precision, device_type=device, **setting)


# ----------------------------------------------------------------------------- tracker == real step


@pytest.mark.parametrize("precision", ["fp32", "bf16", "amp-bf16"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_meta_simulation_equals_real_cpu_step(precision, checkpointing):
    """Peaks per phase, bytes saved for backward and optimizer state: meta == real CPU, byte for byte."""
    real = run_step(TINY_LLAMA, "cpu", precision, gradient_checkpointing=checkpointing)
    simulated = run_step(TINY_LLAMA, "meta", precision, gradient_checkpointing=checkpointing)
    for key in ("peak_bytes", "phase_peaks", "components", "saved_bytes", "optimizer_state_bytes"):
        assert simulated[key] == real[key], key
    assert real["peak_bytes"] > 0 and real["saved_bytes"] > 0


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_meta_simulation_equals_real_cpu_step_with_dropout_and_tied_weights(optimizer):
    real = run_step(TINY_GPT2, "cpu", "fp32", optimizer=optimizer)
    simulated = run_step(TINY_GPT2, "meta", "fp32", optimizer=optimizer)
    assert simulated["phase_peaks"] == real["phase_peaks"]
    assert simulated["saved_bytes"] == real["saved_bytes"]


def test_meta_simulation_equals_real_cpu_step_for_sdpa_math_kernel():
    """fp32 with grouped-query attention: CUDA runs SDPA's math kernel, which the CPU can run too."""
    real = run_step(TINY_LLAMA, "cpu", "fp32", attn="default")
    simulated = run_step(TINY_LLAMA, "meta", "fp32", attn="default")
    assert simulated["phase_peaks"] == real["phase_peaks"]


def test_pythia_14m_components_at_the_optimizer_peak():
    """pythia-14m (real config) in fp32 with AdamW at a short sequence peaks in the optimizer step,
    with weights, grads, both moments and one AdamW intermediate per parameter alive (4 bytes per
    parameter each, counted in caching-allocator blocks, which are at least the bytes asked for)."""
    from pipeline.inputs.configs import config_from_dict
    from pipeline.inputs.modeling import build
    from pipeline.simulate import loop_peak
    from pipeline.simulate.kernels.cuda import CUBLAS_WORKSPACES

    facts = small_facts("EleutherAI/pythia-14m")
    model = build(config_from_dict(facts), "fp32", device="meta")
    weights = sum(p.nbytes for p in model.parameters())
    result = loop_peak(facts, Run(1, 64, "fp32"))
    parts = result.components
    assert result.details["peak_phase"] == "optimizer"
    assert result.details["optimizer_state_bytes"] == 2 * weights  # storage bytes, as pipeline.measure.point reports them
    for name, copies in (("parameters", 1), ("gradients", 1), ("optimizer_state", 2), ("optimizer_intermediates", 1)):
        assert copies * weights <= parts[name] <= copies * weights * 1.01, name
    assert parts["activations"] >= sum(CUBLAS_WORKSPACES)
    assert result.peak_bytes == sum(parts.values())


def test_meta_output_cache_changes_nothing(monkeypatch):
    """The cache of meta-kernel outputs is a speed-up only: cold, warm and without it, the same bytes
    (it must not turn a view, e.g. _unsafe_view, into a fresh storage)."""
    import pipeline.simulate.memory.tracker as tracker
    from pipeline.simulate import loop_peak
    from pipeline.simulate.memory.output_cache import MetaOutputCache

    monkeypatch.setattr(tracker, "SHARED_OUTPUT_CACHE", MetaOutputCache())
    facts = dict(TINY_LLAMA, num_hidden_layers=3)
    cold = loop_peak(facts, Run(2, 48, "amp-bf16", checkpointing=True))
    warm = loop_peak(facts, Run(2, 48, "amp-bf16", checkpointing=True))

    class NoCache:
        def run(self, func, args, kwargs):
            return func(*args, **kwargs)

    monkeypatch.setattr(tracker, "SHARED_OUTPUT_CACHE", NoCache())
    uncached = loop_peak(facts, Run(2, 48, "amp-bf16", checkpointing=True))
    assert cold.details["phase_peaks"] == warm.details["phase_peaks"] == uncached.details["phase_peaks"]


# ----------------------------------------------------------------------------- CUDA rules


def test_sdpa_kernel_choice_follows_cuda_rules():
    import torch

    from pipeline.simulate.kernels.sdpa import choose_sdpa_backend

    def qkv(dtype, heads=8, kv_heads=8, head_dim=64):
        q = torch.empty(2, heads, 16, head_dim, dtype=dtype, device="meta")
        k = torch.empty(2, kv_heads, 16, head_dim, dtype=dtype, device="meta")
        return q, k, k

    # torch 2.11's cu130 build on sm90 tries cuDNN first for half-precision heads up to 128
    mask = torch.empty(16, 16, dtype=torch.bfloat16, device="meta")
    assert choose_sdpa_backend(*qkv(torch.bfloat16), None, 0.0, False) == "cudnn"
    assert choose_sdpa_backend(*qkv(torch.bfloat16, kv_heads=2), None, 0.0, True) == "cudnn"
    assert choose_sdpa_backend(*qkv(torch.bfloat16), mask, 0.0, False) == "cudnn"
    assert choose_sdpa_backend(*qkv(torch.bfloat16, head_dim=192), None, 0.0, False) == "flash"
    assert choose_sdpa_backend(*qkv(torch.bfloat16, head_dim=512), None, 0.0, False) == "efficient"
    assert choose_sdpa_backend(*qkv(torch.bfloat16, head_dim=192), mask, 0.0, False) == "efficient"
    assert choose_sdpa_backend(*qkv(torch.float32), None, 0.0, False) == "efficient"
    assert choose_sdpa_backend(*qkv(torch.float32, kv_heads=2), None, 0.0, True) == "math"


def test_fp32_long_sequences_grow_quadratically_with_the_math_kernel():
    """fp32 with grouped-query attention materialises (B, H, L, L) scores; bf16 (flash) does not."""
    from pipeline.simulate import loop_peak

    facts = dict(TINY_LLAMA, num_hidden_layers=1)
    saved = {(p, length): loop_peak(facts, Run(1, length, p)).details["saved_bytes"]
             for p in ("fp32", "bf16") for length in (64, 128)}
    # S(2L) - 2 S(L) keeps only the quadratic part: (4 heads, L, L) fp32 probabilities at least
    quadratic = (4 * 128 * 128 - 2 * 4 * 64 * 64) * 4
    assert saved[("fp32", 128)] - 2 * saved[("fp32", 64)] >= 0.95 * quadratic
    assert abs(saved[("bf16", 128)] - 2 * saved[("bf16", 64)]) < 0.05 * quadratic


def test_amp_keeps_bf16_weight_casts_until_the_forward_ends():
    """amp-bf16 saves the bf16 copies of the weights for backward (autocast's cast cache)."""
    from pipeline.simulate import loop_peak

    facts = dict(TINY_LLAMA, vocab_size=64)
    amp = loop_peak(facts, Run(1, 16, "amp-bf16")).details["saved_bytes"]
    fp32 = loop_peak(facts, Run(1, 16, "fp32")).details["saved_bytes"]
    layer_linears = 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 160)  # q, o, k, v, gate, up, down per layer
    assert amp >= layer_linears * 2  # bf16 copies (2 bytes each)
    assert amp != fp32


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("kwargs, message", [
    (dict(batch=0), "batch"),
    (dict(seq=-3), "seq"),
    (dict(precision="fp16"), "precision"),
    (dict(optimizer="adam"), "optimizer"),
    (dict(attn_implementation="flash"), "attn_implementation"),
    (dict(checkpointing="yes"), "checkpointing"),
])
def test_bad_arguments_raise_user_error(kwargs, message):
    from pipeline.simulate import loop_peak

    arguments = dict(batch=1, seq=8, precision="fp32")
    arguments.update(kwargs)
    with pytest.raises(UserError, match=message):
        loop_peak(TINY_LLAMA, Run(**arguments))


def test_bad_configs_raise_user_error():
    from pipeline.simulate import loop_peak

    with pytest.raises(UserError, match="model_type"):
        loop_peak({"model_type": "no-such-model"}, Run(1, 8, "fp32"))
    with pytest.raises(UserError, match="hidden size 30 is not a multiple of 4 attention heads"):
        loop_peak(dict(TINY_GPT2, n_embd=30), Run(1, 8, "fp32"))


def run_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300)


def test_cli_bad_config_is_one_line(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    out = run_cli("simulate", "--config", str(bad), "--batch", "1", "--seq", "8", "--json")
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "not a JSON config file" in out.stderr
    out = run_cli("simulate", "--config", str(bad), "--batch", "0", "--seq", "8")
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0


def test_cli_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(small_facts("EleutherAI/pythia-14m")))
    out = run_cli("simulate", "--config", str(path), "--batch", "2", "--seq", "64", "--precision", "bf16",
                  "--checkpointing", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert set(result["components"]) == {"parameters", "gradients", "optimizer_state", "optimizer_intermediates",
                                         "activations"}
    assert result["peak_bytes"] == max(result["phase_peaks"].values()) > 0


def test_simulate_peaks_stage(tmp_path):
    """The stage predicts every ok/oom row of a peak table (here a hand-made one) and keeps going
    past a model without config."""
    import pandas as pd

    from pipeline.simulate.peaks import simulate_peaks

    facts = small_facts("EleutherAI/pythia-14m")
    configs = tmp_path / "configs.json"
    configs.write_text(json.dumps({"EleutherAI/pythia-14m": {
        "family": "pythia", "model_type": "gpt_neox", "status": "ok", "reason": None,
        "config_source": "embedded", "config_revision": None, "config": facts}}))
    base = dict(precision="bf16", variant="standard", optimizer="adamw", gradient_checkpointing=False,
                attn_implementation="default", batch_size=1, seq_len=64, status="ok")
    peaks = pd.DataFrame([dict(base, model_id="EleutherAI/pythia-14m"), dict(base, model_id="unknown/model"),
                          dict(base, model_id="EleutherAI/pythia-14m", seq_len=128, status="skipped")])
    peaks.to_parquet(tmp_path / "peaks.parquet")
    frame = simulate_peaks(tmp_path / "peaks.parquet", configs, tmp_path / "simulated.parquet")
    assert len(frame) == 2
    statuses = dict(zip(frame["model_id"], frame["simulate_status"]))
    assert statuses == {"EleutherAI/pythia-14m": "ok", "unknown/model": "skipped"}
    assert pd.read_parquet(tmp_path / "simulated.parquet")["simulated_peak_bytes"].iloc[0] > 0


# ----------------------------------------------------------------------------- against the H200


SMALL_MODELS = ("EleutherAI/pythia-14m", "EleutherAI/pythia-70m", "openai-community/gpt2",
                "HuggingFaceTB/SmolLM2-135M")


@pytest.mark.skipif(not PEAKS.exists(), reason="results/peak_memory.parquet (GPU sweep) is not committed yet")
def test_predictions_match_measured_h200_peaks_for_small_models():
    import pandas as pd

    from pipeline.inputs.configs import load_configs
    from pipeline.simulate import loop_peak

    peaks = pd.read_parquet(PEAKS)
    rows = peaks[(peaks["status"] == "ok") & peaks["model_id"].isin(SMALL_MODELS) & (peaks["variant"] == "standard")]
    if rows.empty:
        pytest.skip("no ok rows of the small models in the peak table")
    configs = load_configs(REPO / "results" / "configs.json")
    rows = rows.groupby(["model_id", "precision"]).head(3)
    errors = []
    for row in rows.itertuples():
        result = loop_peak(configs[row.model_id].config, Run.from_row(row))
        errors.append(abs(result.peak_bytes - row.peak_allocated_bytes) / row.peak_allocated_bytes)
    errors.sort()
    assert errors[len(errors) // 2] <= 0.03
    assert errors[-1] <= 0.10


# ----------------------------------------------------------------------------- the autocast emulation


def test_cuda_autocast_alone_casts_a_plain_meta_forward():
    """pipeline.training.autocast.CudaAutocast without the simulator: matmuls in bf16, reductions and
    losses in fp32, one bf16 copy of a weight per forward (the cast cache), nothing outside."""
    import torch

    from pipeline.training.autocast import CudaAutocast

    linear = torch.nn.Linear(8, 8, device="meta")
    x = torch.empty(2, 8, device="meta")
    emulation = CudaAutocast(device_type="meta")
    casts = []
    with emulation.autocast(torch.bfloat16):
        first = linear(x)
        casts.append(next(iter(emulation.cast_cache.values()))[1])
        second = linear(x)
        casts.append(next(iter(emulation.cast_cache.values()))[1])
        total = first.sum()
        loss = torch.nn.functional.cross_entropy(first, torch.zeros(2, dtype=torch.long, device="meta"))
    assert first.dtype == second.dtype == torch.bfloat16
    assert total.dtype == loss.dtype == torch.float32
    assert casts[0] is casts[1] and len(emulation.cast_cache) == 0  # cleared when the forward ends
    assert not emulation.active() and linear(x).dtype == torch.float32
