"""GPU tests of the peak-memory sweep: a small real sweep whose numbers must make sense.

    python3 -m pytest -m gpu tests/test_measure_gpu.py     # with pytest
    python3 tests/test_measure_gpu.py                      # without pytest (the GPU machine has none)

Runs pythia-14m and SmolLM2-135M (configs from tests/data/models_small.yaml, no jsonschema needed)
through the real fork machinery on CUDA, fp32 and bf16, a few points, plus checkpointing and SGD;
then SmolLM2-135M with transformers.Trainer (amp-bf16, its default fused AdamW; amp-fp16 with SGD)
and the loop in amp-fp16.
This process never initialises CUDA itself (the children do), so the fork stays safe.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import yaml  # noqa: E402

from pipeline.inputs.records import load_model_records
from pipeline.measure import sweep  # noqa: E402
from pipeline.measure.device import cuda_available  # noqa: E402

try:
    import pytest

    pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")]
except ImportError:  # plain-script mode
    pytest = None

MODELS = ("EleutherAI/pythia-14m", "HuggingFaceTB/SmolLM2-135M")
SMOLLM = MODELS[1]
BATCHES, SEQS = (1, 2, 4), (128, 256)
SIZE = {"fp32": 4, "bf16": 2}
_RESULT = {}


def write_configs(folder: Path) -> Path:
    small = {m["id"]: m for m in yaml.safe_load((REPO / "tests/data/models_small.yaml").read_text())["models"]}
    configs = {model_id: {"family": small[model_id]["family"], "model_type": small[model_id]["config"]["model_type"],
                          "status": "ok", "reason": None, "config_source": "embedded", "config_revision": None,
                          "config": small[model_id]["config"]} for model_id in MODELS}
    path = folder / "configs.json"
    path.write_text(json.dumps(configs))
    return path


def gpu_sweep():
    """Run the small sweep once (module-wide): returns (folder, rows of the aggregated table)."""
    if not _RESULT:
        folder = Path(tempfile.mkdtemp(prefix="avp-gpu-"))
        configs = write_configs(folder)
        plan = sweep.parse_plan({
            "grid": {"batch_sizes": list(BATCHES), "seq_lens": list(SEQS)}, "precisions": ["fp32", "bf16"],
            "models": list(MODELS),
            "variants": [{"name": "ckpt", "gradient_checkpointing": True, "models": [SMOLLM], "points": [[4, 256]]},
                         {"name": "sgd", "optimizer": "sgd", "models": [SMOLLM], "points": [[4, 256]]}]})
        records, missing = load_model_records(configs, MODELS)
        assert not missing
        outcomes = sweep.run_sweep(sweep.plan_jobs(plan, records), folder / "parts", device="cuda", child_timeout=180)
        assert outcomes["finished"] == 4, outcomes
        frame = sweep.aggregate(folder / "parts", folder / "peak_memory.parquet")
        _RESULT.update(folder=folder, configs=configs, rows=frame.to_dict("records"))
    return _RESULT["folder"], _RESULT["rows"]


def standard(rows):
    return [r for r in rows
            if r["variant"] == "standard" and r["optimizer"] == "adamw" and not r["gradient_checkpointing"]]


def test_every_point_ran_on_the_gpu():
    _, rows = gpu_sweep()
    assert len(rows) == len(MODELS) * 2 * len(BATCHES) * len(SEQS) + 2 * 2
    assert {r["status"] for r in rows} == {"ok"}, [(r["model_id"], r["reason"]) for r in rows if r["status"] != "ok"]
    for r in rows:
        assert r["measure_device"] == "cuda" and r["gpu_total_bytes"] > 0 and r["device"]
        assert r["cuda_version"] and r["allow_tf32"] in (True, False)


def test_weights_and_optimizer_state_have_their_exact_sizes():
    _, rows = gpu_sweep()
    for r in rows:
        size = SIZE[r["precision"]]
        moments = 1 if r["optimizer"] == "sgd" else 2  # AdamW's step counters stay on the CPU
        assert r["optimizer_state_bytes"] == moments * r["parameters"] * size, r
        assert r["weights_bytes"] >= r["parameters"] * size
        # Back to the weights before every point: nothing leaks from one point into the next, except
        # the cuBLAS workspaces that torch keeps after the first matmul (tens of MiB at most).
        assert 0 <= r["allocated_before_bytes"] - r["weights_bytes"] <= 256 * 2**20, r


def test_peak_is_above_weights_plus_state_and_is_the_max_of_the_phases():
    _, rows = gpu_sweep()
    for r in rows:
        phases = [r["forward_peak_bytes"], r["backward_peak_bytes"], r["optimizer_peak_bytes"]]
        assert r["peak_allocated_bytes"] == max(phases)
        assert r["peak_allocated_bytes"] > r["weights_bytes"] + r["optimizer_state_bytes"]
        assert r["peak_reserved_bytes"] >= r["peak_allocated_bytes"]
        if r["nvml_used_bytes"] is not None:  # None where NVML cannot see this process (PID namespace)
            assert r["nvml_used_bytes"] >= r["peak_reserved_bytes"]
        assert r["step_seconds"] > 0 and r["tokens_per_second"] > 0


def test_bf16_needs_less_than_fp32_at_the_same_point():
    _, rows = gpu_sweep()
    peaks = {(r["model_id"], r["precision"], r["batch_size"], r["seq_len"]): r["peak_allocated_bytes"]
             for r in standard(rows)}
    for model_id in MODELS:
        for batch in BATCHES:
            for seq in SEQS:
                assert peaks[(model_id, "bf16", batch, seq)] < peaks[(model_id, "fp32", batch, seq)]


def test_peak_does_not_decrease_with_batch_size():
    _, rows = gpu_sweep()
    peaks = {(r["model_id"], r["precision"], r["batch_size"], r["seq_len"]): r["peak_allocated_bytes"]
             for r in standard(rows)}
    for model_id in MODELS:
        for precision in SIZE:
            for seq in SEQS:
                series = [peaks[(model_id, precision, batch, seq)] for batch in BATCHES]
                assert series == sorted(series), (model_id, precision, seq, series)


def test_checkpointing_and_sgd_lower_the_peak():
    _, rows = gpu_sweep()
    at = {(r["precision"], r["optimizer"], r["gradient_checkpointing"]): r["peak_allocated_bytes"]
          for r in rows if r["model_id"] == SMOLLM and (r["batch_size"], r["seq_len"]) == (4, 256)}
    for precision in SIZE:
        assert at[(precision, "adamw", True)] < at[(precision, "adamw", False)]
        assert at[(precision, "sgd", False)] < at[(precision, "adamw", False)]


def trainer_sweep():
    """SmolLM2-135M with the Trainer (amp-bf16, fused AdamW, two points; amp-fp16, SGD, K=2) and the
    loop in amp-fp16, in their own processes: rows by (client, precision, B, L)."""
    if "trainer_rows" not in _RESULT:
        folder, _ = gpu_sweep()
        plan = sweep.parse_plan({
            "grid": {"batch_sizes": [2, 4], "seq_lens": [256]}, "precisions": ["amp-fp16"], "models": [SMOLLM],
            "variants": [
                {"name": "trainer", "client": "trainer", "precisions": ["amp-bf16"], "models": [SMOLLM]},
                {"name": "trainer fp16", "client": "trainer", "optim": "sgd", "gradient_accumulation": 2,
                 "precisions": ["amp-fp16"], "models": [SMOLLM], "points": [[4, 256]]}]})
        records, missing = load_model_records(_RESULT["configs"], [SMOLLM])
        assert not missing
        parts = folder / "trainer_parts"
        outcomes = sweep.run_sweep(sweep.plan_jobs(plan, records), parts, device="cuda", child_timeout=180)
        assert outcomes["finished"] == 3, outcomes
        frame = sweep.aggregate(parts, folder / "trainer_peak_memory.parquet")
        _RESULT["trainer_rows"] = {(r["client"], r["precision"], r["optim"], r["batch_size"], r["seq_len"]): r
                                   for r in frame.to_dict("records")}
    return _RESULT["trainer_rows"]


def test_trainer_points_have_plausible_peaks():
    rows = trainer_sweep()
    assert {r["status"] for r in rows.values()} == {"ok"}, [r["reason"] for r in rows.values()]
    first, r = rows[("trainer", "amp-bf16", "adamw_torch_fused", 2, 256)], rows[("trainer", "amp-bf16",
                                                                                 "adamw_torch_fused", 4, 256)]
    n = r["parameters"]
    import pandas as pd

    assert r["gradient_accumulation"] == 1 and r["steps"] == 3 and pd.isna(r["optimizer"])
    # fused AdamW: two fp32 moments plus a 4-byte step counter per parameter tensor, on the GPU
    assert 0 < r["optimizer_state_bytes"] - 2 * 4 * n <= 4 * 1000, r
    assert r["weights_bytes"] >= 4 * n
    # at the optimizer step: fp32 weights, fp32 gradients and both moments are alive together
    assert r["peak_allocated_bytes"] > r["weights_bytes"] + 4 * n + r["optimizer_state_bytes"]
    assert r["peak_allocated_bytes"] > first["peak_allocated_bytes"]
    phases = [r["forward_peak_bytes"], r["backward_peak_bytes"], r["optimizer_peak_bytes"]]
    assert None not in phases and r["peak_allocated_bytes"] >= max(phases)
    assert r["peak_reserved_bytes"] >= r["peak_allocated_bytes"]
    # the Trainer's point left nothing behind for the next one (cuBLAS workspaces aside)
    assert 0 <= r["allocated_before_bytes"] - r["weights_bytes"] <= 256 * 2**20, r


def test_amp_fp16_in_the_loop_and_the_trainer():
    rows = trainer_sweep()
    loop = rows[("loop", "amp-fp16", "adamw_torch", 4, 256)]
    assert loop["optimizer_state_bytes"] == 2 * loop["parameters"] * 4  # fp32 state (foreach: steps on the CPU)
    assert loop["peak_allocated_bytes"] > loop["weights_bytes"] + loop["optimizer_state_bytes"]
    sgd = rows[("trainer", "amp-fp16", "sgd", 4, 256)]
    assert sgd["gradient_accumulation"] == 2 and sgd["tokens"] == 4 * 256 * 2
    assert sgd["optimizer_state_bytes"] == 0  # transformers' "sgd" has no momentum
    assert sgd["peak_allocated_bytes"] < rows[("trainer", "amp-bf16", "adamw_torch_fused", 4, 256)][
        "peak_allocated_bytes"]


def test_measure_command_on_the_gpu():
    folder, _ = gpu_sweep()
    result = subprocess.run([sys.executable, "-m", "pipeline.measure", "measure", "--model", SMOLLM, "--configs",
                             str(_RESULT["configs"]), "--batch", "2", "--seq", "128", "--precision", "amp-bf16",
                             "--json"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    row = json.loads(result.stdout.strip().splitlines()[-1])
    assert row["status"] == "ok" and row["precision"] == "amp-bf16"
    assert row["optimizer_state_bytes"] == 2 * row["parameters"] * 4  # fp32 state under autocast
    assert row["peak_allocated_bytes"] > row["weights_bytes"] + row["optimizer_state_bytes"]


if __name__ == "__main__":
    if not cuda_available():
        print("no CUDA device: nothing to test")
        sys.exit(0)
    failed = 0
    for name, test in [(n, f) for n, f in list(globals().items()) if n.startswith("test_") and callable(f)]:
        try:
            test()
            print(f"PASS {name}")
        except Exception as exc:  # noqa: BLE001 - report every test, then fail
            failed += 1
            print(f"FAIL {name}: {type(exc).__name__}: {str(exc)[:2000]}")
    print(f"{failed} failed" if failed else "all passed", f"(results in {_RESULT.get('folder')})")
    sys.exit(1 if failed else 0)
