"""`estimate` for transformers.Trainer runs (client = trainer): the exact method against a measured
H100 row, a TrainingArguments JSON written by transformers itself, the closed forms' optimizer
terms, and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from pipeline.cli import main
from pipeline.inputs.configs import read_config_records
from pipeline.core.errors import UserError
from pipeline.estimate import estimate
from pipeline.estimate.api import make_run

REPO = Path(__file__).resolve().parent.parent
H100_TRAINER = REPO / "results/trainer/h100/peak_memory.parquet"


def measured(model_id: str, **where) -> dict:
    frame = pd.read_parquet(H100_TRAINER)
    rows = frame[(frame["model_id"] == model_id) & (frame["status"] == "ok")]
    for column, value in where.items():
        rows = rows[rows[column] == value]
    assert len(rows) == 1
    return rows.iloc[0].to_dict()


def test_exact_trainer_estimate_matches_the_h100_row():
    """GPT-2, Trainer defaults (fused AdamW, bf16=True), B=4, L=512: measured as the first point of
    a process on an H100 (commit 4ef21df)."""
    row = measured("openai-community/gpt2", precision="amp-bf16", batch_size=4, seq_len=512)
    config = read_config_records(REPO / "results/configs.json")["openai-community/gpt2"]["config"]
    result = estimate(config=config, batch=4, seq=512, precision="amp-bf16", method="exact", client="trainer",
                      gpu="H100 80GB")
    assert result["client"] == "trainer" and result["optim"] == "adamw_torch_fused" and result["optimizer"] is None
    assert row["peak_allocated_bytes"] == 4_711_264_768
    assert abs(result["peak_bytes"] / row["peak_allocated_bytes"] - 1) < 0.005
    assert abs(result["peak_reserved_bytes"] / row["peak_reserved_bytes"] - 1) < 0.10
    assert result["fits"] is True


def test_training_args_json_written_by_transformers(tmp_path):
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=6,
                             gradient_accumulation_steps=4, bf16=True, gradient_checkpointing=True,
                             optim="adafactor", torch_compile=True, use_cpu=True)
    path = tmp_path / "training_args.json"
    path.write_text(args.to_json_string())
    run, notes = make_run(seq=1024, training_args=path)
    assert (run.client, run.batch, run.gradient_accumulation, run.precision, run.checkpointing, run.optim) == \
        ("trainer", 6, 4, "amp-bf16", True, "adafactor")
    # bf16=True on weights of no declared dtype: fp32 (amp-bf16), said in a note
    assert notes[0] == "training args: torch.compile is not modelled"
    assert notes[1].startswith("the weights' dtype is not known (the config names none): fp32 weights are assumed")
    run, _ = make_run(batch=2, seq=1024, optim="sgd", training_args=path)  # explicit options win
    assert (run.batch, run.optim) == (2, "sgd")


def test_closed_forms_take_the_trainers_optimizer_state():
    """Per parameter in amp-bf16 (fp32 state): fused AdamW 8 bytes and no temporaries, transformers'
    sgd (no momentum) none, 8-bit AdamW 2 bytes; the loop's AdamW 8 bytes plus a weight copy."""
    n = 1_000_000_000
    parts = {optim: estimate(params=n, batch=1, seq=512, precision="amp-bf16", method="blog", client="trainer",
                             optim=optim)["components"] for optim in ("adamw_torch_fused", "sgd", "adamw_bnb_8bit")}
    assert parts["adamw_torch_fused"]["optimizer_state"] == 8 * n
    assert parts["sgd"]["optimizer_state"] == 0
    assert parts["adamw_bnb_8bit"]["optimizer_state"] == 2 * n
    loop = estimate(params=n, batch=1, seq=512, precision="amp-bf16", method="blog")
    assert loop["client"] == "loop" and loop["optimizer"] == "adamw" and loop["components"]["optimizer_state"] == 8 * n


@pytest.mark.parametrize("options, message", [
    (dict(client="trainer", optim="adam"), "optim 'adam' is not one of adamw_torch_fused"),
    (dict(client="trainer", gradient_accumulation=0), "gradient_accumulation must be a positive integer"),
    (dict(optim="adafactor"), "optim is the trainer client's; the loop takes optimizer"),
    (dict(client="trainer", optimizer="sgd"), "optimizer is the loop client's"),
    (dict(gradient_accumulation=4), "gradient_accumulation other than 1 needs a Trainer client"),
])
def test_bad_trainer_options_are_one_line_errors(options, message):
    with pytest.raises(UserError, match=message):
        estimate(params=1e9, batch=1, seq=8, precision="bf16", method="blog", **options)


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", json.dumps({"per_device_train_batch_size": 0}),
                                     json.dumps({"bf16": True, "fp16": True})])
def test_bad_training_args_file_is_one_line_and_exit_2(content, tmp_path, capsys):
    path = tmp_path / "args.json"
    path.write_text(content)
    code = main(["estimate", "--params", "1e9", "--seq", "8", "--precision", "bf16", "--method", "blog",
                 "--training-args", str(path)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith(f"error: {path}") and "\n" not in err


def test_cli_trainer_answer(capsys):
    assert main(["estimate", "--params", "1e9", "--batch", "2", "--seq", "512", "--precision", "amp-fp16",
                 "--method", "blog", "--client", "trainer", "--optim", "adamw_bnb_8bit",
                 "--gradient-accumulation", "4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["client"], result["optim"], result["gradient_accumulation"], result["precision"]) == \
        ("trainer", "adamw_bnb_8bit", 4, "amp-fp16")
