"""Any training code, traced (`pipeline.trace`, pipeline.simulate.trace).

A hand-written loop (a chunked cross-entropy over the sequence, computed outside the model's forward)
traced on the meta device counts exactly what the same code counts when it runs for real on the CPU
with real weights under the same tracker; the standard loop written by hand and traced equals the
loop simulator's prediction (`loop_peak`); the trace answers the estimators' `Estimate` and a fit
verdict; bad use is one clear line.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO, TINY_GPT2, TINY_LLAMA, offline_env

import pipeline
from pipeline.core.errors import UserError
from pipeline.training.values import Estimate, Run

KEYS = ("peak_bytes", "components", "phase_peaks", "reserved_bytes", "reserved_expandable_bytes")


def chunked_loss(model, ids, chunk: int = 8):
    """Next-token cross-entropy over chunks of the sequence: the (B, L, V) logits never exist at once."""
    import torch
    import torch.nn.functional as F

    hidden = model.model(input_ids=ids).last_hidden_state
    total, count = 0.0, ids.shape[0] * (ids.shape[1] - 1)
    for start in range(0, ids.shape[1] - 1, chunk):
        logits = model.lm_head(hidden[:, start:start + chunk]).float()
        targets = ids[:, start + 1:start + 1 + chunk]
        logits = logits[:, :targets.shape[1]]
        total = total + F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    return total / count


def run_chunked(device: str, precision: str, checkpointing: bool = False):
    import torch

    torch.manual_seed(0)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    with pipeline.trace(device=device) as t:
        model = t.build(TINY_LLAMA, dtype=dtype, attn_implementation="eager")  # CUDA's SDPA kernels: no CPU
        if checkpointing:
            model.gradient_checkpointing_enable()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(3):
            ids = t.batch(2, 24)
            if precision == "amp-bf16":
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = chunked_loss(model, ids)
            else:
                loss = chunked_loss(model, ids)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return t


@pytest.mark.parametrize("precision,checkpointing", [("fp32", False), ("bf16", False), ("amp-bf16", True)])
def test_a_chunked_loss_traced_on_meta_equals_a_real_cpu_run(precision, checkpointing):
    """Byte for byte: the peak, its components, the phase peaks and the reserved bytes."""
    real = run_chunked("cpu", precision, checkpointing)
    traced = run_chunked("meta", precision, checkpointing)
    for key in KEYS:
        assert getattr(traced, key) == getattr(real, key), key
    assert traced.peak_phase == real.peak_phase
    assert set(traced.phase_peaks) == {"setup", "forward", "backward", "optimizer"}
    parts = traced.components
    assert traced.peak_phase == "optimizer" and min(parts.values()) > 0


def standard_loop(t, config, batch, seq, precision, checkpointing=False):
    """The standard step of docs/definitions.md, written as a user would, three times."""
    import torch

    model = t.build(config, dtype=torch.bfloat16 if precision == "bf16" else torch.float32)
    if checkpointing:
        model.gradient_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        ids = t.batch(batch, seq)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "amp-bf16"):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("config,precision,checkpointing,fresh", [
    (TINY_LLAMA, "fp32", False, False), (TINY_LLAMA, "amp-bf16", True, False), (TINY_GPT2, "bf16", False, False),
    (TINY_LLAMA, "fp32", False, True), (TINY_GPT2, "amp-bf16", True, True)])
def test_the_standard_loop_traced_equals_the_loop_simulator(config, precision, checkpointing, fresh):
    """The loop client is the trace's installation with its phases marked by the step itself; the
    hand-written loop, traced, answers the same peak, components and reserved bytes (the phase peaks
    of its forward and backward may differ: loop_peak adds step 1's state to them instead of running
    steps 2 and 3). In a fresh process both build the model in the trace and make cuBLAS's workspaces
    at their first use; the loop then replays steps 2 and 3 without making them again."""
    from pipeline.simulate import loop_peak

    with pipeline.trace(fresh_process=fresh) as t:
        standard_loop(t, config, 2, 24, precision, checkpointing)
    predicted = loop_peak(config, Run(2, 24, precision, checkpointing=checkpointing, fresh_process=fresh))
    assert t.peak_bytes == predicted.peak_bytes
    assert t.components == predicted.components
    assert t.reserved_bytes == predicted.reserved_bytes
    assert t.reserved_expandable_bytes == predicted.reserved_expandable_bytes
    assert t.phase_peaks["optimizer"] == predicted.details["phase_peaks"]["optimizer"]


def test_the_answer_is_an_estimate_with_a_fit_verdict():
    with pipeline.trace(gpu="H100 80GB", fresh_process=False) as t:
        standard_loop(t, TINY_LLAMA, 2, 24, "fp32")
    estimate = t.estimate
    assert isinstance(estimate, Estimate)
    assert estimate.peak_bytes == t.peak_bytes and estimate.reserved_bytes == t.reserved_bytes
    assert t.fits is True and estimate.details["fits"] is True and estimate.details["gpu"] == "H100 80GB"
    assert estimate.details["peak_phase"] == "optimizer"
    with pipeline.trace(gpu_memory_gib=0.001) as small:
        standard_loop(small, TINY_LLAMA, 2, 24, "fp32")
    assert small.fits is False and small.estimate.details["reserve_limit_exceeded"]
    with pipeline.trace() as none:
        standard_loop(none, TINY_LLAMA, 1, 8, "fp32")
    assert none.fits is None and "fits" not in none.estimate.details


def test_a_logged_loss_is_answered_and_noted_a_data_branch_is_refused():
    import torch

    with pipeline.trace() as t:
        model = t.build(TINY_LLAMA)
        ids = t.batch(1, 8)
        loss = model(input_ids=ids, labels=ids).loss
        assert loss.item() == 0.0
        loss.backward()
    assert t.peak_bytes > 0 and t.phase_peaks["backward"] > 0
    assert any(".item()" in note for note in t.estimate.details["notes"])
    with pytest.raises(UserError, match="value of a torch.int64 meta tensor"):
        with pipeline.trace() as t:
            model = t.build(TINY_LLAMA)
            int(t.batch(1, 8).sum())


def test_autocast_and_optimizer_defaults_are_restored():
    import torch
    import torch.optim.optimizer as optimizer_module

    methods = (torch.amp.autocast_mode.autocast.__enter__, torch.autograd.backward, torch.amp.GradScaler.__init__)
    with pipeline.trace() as t:
        t.build(TINY_LLAMA)
        assert "meta" in optimizer_module._get_foreach_kernels_supported_devices()
    assert "meta" not in optimizer_module._get_foreach_kernels_supported_devices()
    assert (torch.amp.autocast_mode.autocast.__enter__, torch.autograd.backward,
            torch.amp.GradScaler.__init__) == methods


@pytest.mark.parametrize("call,message", [
    (lambda: pipeline.trace(gpu="H1000"), "unknown GPU"),
    (lambda: pipeline.trace(gpu="H100 80GB", gpu_memory_gib=80), "not both"),
    (lambda: pipeline.trace(device="cuda"), "device"),
    (lambda: pipeline.trace(fresh_process="yes"), "fresh_process"),
])
def test_bad_arguments_are_one_line(call, message):
    with pytest.raises(UserError, match=message):
        call()


def test_bad_use_is_one_line():
    t = pipeline.trace()
    with pytest.raises(UserError, match="inside the trace"):
        t.build(TINY_LLAMA)
    with pytest.raises(UserError, match="after its with block"):
        t.peak_bytes
    with t:
        with pytest.raises(UserError, match="dtype"):
            t.build(TINY_LLAMA, dtype="fp16")
        with pytest.raises(UserError, match="build or watch one first"):
            t.batch(1, 8)
        with pytest.raises(UserError, match="model_type"):
            t.build({"model_type": "no-such-model"})
    with pytest.raises(UserError, match="one block"):
        with t:
            pass


def test_importing_the_package_imports_no_torch():
    code = "import sys, pipeline; print(sorted({'torch', 'transformers'} & set(sys.modules)), callable(pipeline.trace))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out == "[] True\n"


@pytest.mark.parametrize("precision,checkpointing", [("amp-bf16", False), ("bf16", True)])
def test_the_trainer_client_traced_equals_the_trainer_simulator(precision, checkpointing):
    """transformers.Trainer's steps as the Trainer client runs them (its Trainer on the model, its loop
    re-stated), inside a trace around a model the trace built: the same peak, components and reserved
    bytes as `trainer_peak`. (A user's own `trainer.train()` does not run in a plain trace: the Trainer
    places the model and its batches on a real device and accelerate picks the CPU's autocast; those
    are the client's stand-ins.)"""
    import torch

    from pipeline.simulate.clients.trainer import TrainerRun, fused_on, trainer_peak
    from pipeline.simulate.clients.parts import meta_trainer
    from pipeline.training.step import Setting, set_training_mode

    with pipeline.trace(fresh_process=False) as t:
        model = t.build(TINY_LLAMA, dtype=torch.bfloat16 if precision == "bf16" else torch.float32)
        set_training_mode(model, Setting())
        run = TrainerRun(meta_trainer(model, 2, precision, "adamw_torch_fused", 1, checkpointing, "meta"), 24,
                         precision, checkpointing, "meta")
        run.attach(t.rules, t.tracker)
        try:
            with fused_on("meta"):
                run.setup()
                for _ in range(3):
                    run.step()
        finally:
            run.close()
    predicted = trainer_peak(TINY_LLAMA, Run(2, 24, precision, checkpointing=checkpointing, client="trainer",
                                             fresh_process=False))
    assert t.peak_bytes == predicted.peak_bytes
    assert t.components == predicted.components
    assert t.reserved_bytes == predicted.reserved_bytes


def test_a_model_is_built_from_its_id_or_config_file(tmp_path):
    """A registry id (its embedded config.json facts) or a config.json path, as `estimate` takes them."""
    import json

    from conftest import REPO

    facts = json.loads((REPO / "results" / "configs.json").read_text())["EleutherAI/pythia-14m"]["config"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(facts))
    with pipeline.trace() as t:
        by_id, by_path = t.build("EleutherAI/pythia-14m"), t.build(str(path))
    assert sum(p.numel() for p in by_id.parameters()) == sum(p.numel() for p in by_path.parameters()) > 10**7
    assert t.components["parameters"] >= 2 * 4 * 10**7


def test_a_torchtitan_style_trainer_on_several_gpus_equals_real_gloo_ranks(tmp_path):
    """tests/data/traced_fsdp.py (its own mesh, fully_shard per layer and the root, AdamW): run for real by two gloo
    processes on the CPU, each under pipeline.trace(device="cpu", world_size=2), rank 0's bytes; traced on meta as
    rank 0 of 2 in one process: the same bytes, phase by phase and role by role."""
    import json
    import subprocess
    import sys

    sys.path.insert(0, str(REPO / "tests" / "data"))
    from traced_fsdp import train

    out = tmp_path / "rank0.json"
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             str(REPO / "tests" / "data" / "traced_fsdp.py"), str(out)],
                            capture_output=True, text=True, timeout=600, env=offline_env())
    assert result.returncode == 0, result.stderr[-2000:]
    real = json.loads(out.read_text())
    with pipeline.trace(gpu="H100 80GB", world_size=2) as t:
        train(t, 2)
    assert t.peak_bytes == real["peak_bytes"] and t.phase_peaks == real["phase_peaks"]
    assert {k: v for k, v in t.components.items() if v} == {k: v for k, v in real["components"].items() if v}
    assert t.components["all_gather"] > 0 and t.communicators == 1 and t.fits
