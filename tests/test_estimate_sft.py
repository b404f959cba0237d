"""`estimate` for TRL's SFTTrainer (client sft), bf16-autocast and Liger: the Python functions and the
command, TRL's SFT config file (--sft-config) and TrainingArguments with the weights' dtype, the
closed forms against the exact simulator, and the one-line errors of bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.cli import main
from pipeline.core.errors import UserError
from pipeline.estimate import estimate, max_batch_size, max_seq_len
from pipeline.estimate.api import make_run
from pipeline.inputs.configs import read_config_records
from pipeline.training.packing import Packing

REPO = Path(__file__).resolve().parent.parent
COEFFICIENTS = REPO / "results/coefficients.json"
QWEN = "Qwen/Qwen2.5-0.5B"


def qwen_config(**extra) -> dict:
    return {**read_config_records(REPO / "results/configs.json")[QWEN]["config"], **extra}


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


SFT_YAML = """\
model_name_or_path: Qwen/Qwen2.5-0.5B
dtype: bfloat16
per_device_train_batch_size: 4
max_length: 1024
gradient_accumulation_steps: 2
use_peft: true
lora_r: 8
lora_alpha: 16
lora_target_modules: [q_proj, v_proj]
optim: adamw_torch
packing: true
padding_free: true
output_dir: out
"""


def test_sft_config_file_sets_the_run(tmp_path):
    run, notes = make_run(sft_config=write(tmp_path / "sft.yaml", SFT_YAML))
    assert (run.client, run.batch, run.seq, run.gradient_accumulation, run.precision, run.checkpointing, run.optim) \
        == ("sft", 4, 1024, 2, "bf16-autocast", True, "adamw_torch")
    assert (run.adapter.r, run.adapter.alpha, run.adapter.targets, run.adapter.quantization, run.adapter.dropout) \
        == (8, 16, "q_proj,v_proj", None, 0.05)  # ModelConfig's lora_dropout
    assert notes == [] and run.packing == Packing(True, True)  # packing and padding_free are simulated
    run, _ = make_run(batch=2, seq=512, checkpointing=False, sft_config=write(tmp_path / "sft.yaml", SFT_YAML))
    assert (run.batch, run.seq, run.checkpointing) == (2, 512, False)  # explicit options win


def test_the_deepspeed_key_of_a_training_file_is_its_zero_stage(tmp_path):
    """The file's DeepSpeed config (a path, or its dict) sets the sharding; a missing file is one line."""
    with pytest.raises(UserError, match=r"DeepSpeed config not found"):
        make_run(sft_config=write(tmp_path / "sft.yaml", SFT_YAML + "deepspeed: ds.json\n"), num_gpus=2)
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    run, _ = make_run(sft_config=write(tmp_path / "sft.yaml", SFT_YAML + f"deepspeed: {tmp_path / 'ds.json'}\n"),
                      num_gpus=2)
    assert (run.client, run.sharding) == ("sft", "zero2")
    run, _ = make_run(training_args={"per_device_train_batch_size": 2, "bf16": True,
                                     "deepspeed": {"zero_optimization": {"stage": 3}}}, num_gpus=4, seq=512)
    assert (run.client, run.sharding, run.num_gpus) == ("trainer", "zero3", 4)


def test_sft_config_defaults_are_trls(tmp_path):
    """What `trl sft` runs when the file says little: fp32 weights (ModelConfig.dtype) under bf16 autocast
    (SFTConfig.bf16) = amp-bf16, checkpointing on, max_length 1024, fused AdamW; QLoRA with TRL's LoRA
    defaults (r 16, alpha 32, dropout 0.05) and PEFT's default targets, noted; the file's lora_dropout read."""
    path = write(tmp_path / "sft.json", json.dumps({"per_device_train_batch_size": 2, "use_peft": True,
                                                    "load_in_4bit": True}))
    run, notes = make_run(sft_config=path)
    assert (run.precision, run.checkpointing, run.seq, run.optim) == ("amp-bf16", True, 1024, "adamw_torch_fused")
    assert (run.adapter.method, run.adapter.r, run.adapter.alpha, run.adapter.targets, run.adapter.dropout) \
        == ("qlora", 16, 32, "q_proj,v_proj", 0.05)
    run, _ = make_run(sft_config={"per_device_train_batch_size": 2, "use_peft": True, "lora_dropout": 0})
    assert run.adapter.dropout == 0.0
    with pytest.raises(UserError, match=r"sft config: lora dropout must be a number in \[0, 1\), not 1"):
        make_run(sft_config={"per_device_train_batch_size": 2, "use_peft": True, "lora_dropout": 1})
    assert any("PEFT's default" in note for note in notes) and any("computes the 4-bit matmuls in fp32" in n
                                                                    for n in notes)
    run, _ = make_run(sft_config=path, weights_dtype="bf16")
    assert run.precision == "bf16-autocast"
    run, _ = make_run(sft_config={"fp16": True, "per_device_train_batch_size": 1})
    assert run.precision == "amp-fp16"


def test_the_weights_dtype_picks_the_precision_of_bf16_training():
    """TrainingArguments(bf16=True): bf16 weights make bf16-autocast, fp32 ones amp-bf16; the default is
    what the model's config declares (dtype / torch_dtype), else fp32 with a note."""
    args = {"per_device_train_batch_size": 2, "bf16": True}
    assert make_run(seq=64, training_args=args, weights_dtype="bf16")[0].precision == "bf16-autocast"
    assert make_run(seq=64, training_args=args, declared_dtype=lambda: "bf16")[0].precision == "bf16-autocast"
    run, notes = make_run(seq=64, training_args=args)
    assert run.precision == "amp-bf16" and notes[0].startswith("the weights' dtype is not known")
    assert make_run(seq=64, training_args={"per_device_train_batch_size": 2}, weights_dtype="bf16")[0].precision \
        == "bf16"
    result = estimate(config=qwen_config(torch_dtype="bfloat16"), batch=2, seq=64, client="sft", method="formula",
                      coefficients=COEFFICIENTS)
    assert (result["precision"], result["client"], result["checkpointing"]) == ("bf16-autocast", "sft", True)


def test_exact_sft_from_the_command_line_with_an_sft_config(tmp_path, capsys):
    path = write(tmp_path / "sft.yaml", SFT_YAML)
    assert main(["estimate", "--sft-config", str(path), "--method", "exact", "--gpu", "H100 80GB", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["model_id"], result["client"], result["precision"], result["batch_size"], result["seq_len"]) == \
        (QWEN, "sft", "bf16-autocast", 4, 1024)
    assert result["adapter"]["lora_targets"] == "q_proj,v_proj" and result["fits"] is True
    assert "sft config: the model is its model_name_or_path, Qwen/Qwen2.5-0.5B" in result["notes"]
    assert 1.0 < result["peak_bytes"] / 2**30 < 3.0


def test_sft_is_far_below_the_trainer_with_lora_at_long_sequences():
    """The Trainer keeps (B, L, V) logits and their fp32 gradients; SFTTrainer's fused head a tile."""
    run = dict(config=qwen_config(), batch=4, seq=2048, precision="bf16-autocast", checkpointing=True, lora_r=16,
               method="exact")
    sft = estimate(client="sft", **run)
    trainer = estimate(client="trainer", **run)
    assert trainer["peak_bytes"] > 4 * sft["peak_bytes"]


@pytest.mark.parametrize("checkpointing, lora", [(True, False), (False, False), (True, True)])
def test_the_formula_for_sft_is_near_the_simulator(checkpointing, lora):
    """The closed form (bf16's fit standing in for bf16-autocast, the fused head in config words) against
    the exact simulator, Qwen2.5-0.5B at B=4, L=1024."""
    run = dict(config=qwen_config(), batch=4, seq=1024, precision="bf16-autocast", client="sft",
               checkpointing=checkpointing, lora_r=16 if lora else None, coefficients=COEFFICIENTS)
    formula = estimate(method="formula", **run)
    exact = estimate(method="exact", **run)
    assert abs(formula["peak_bytes"] / exact["peak_bytes"] - 1) < 0.08
    assert any("has no fit of its own yet" in note for note in formula["notes"])


def test_closed_forms_say_what_they_leave_out():
    result = estimate(params=5e8, batch=1, seq=512, precision="bf16-autocast", client="sft", liger_kernel=True,
                      method="heuristic", coefficients=COEFFICIENTS)
    assert result["liger_kernel"] is True and result["client"] == "sft"
    assert any("without the model's shape" in note for note in result["notes"])
    assert "Liger's RMSNorm, RoPE and SwiGLU kernels are not modelled by the closed forms (an over-estimate; " \
           "method exact runs them)" in result["notes"]


def test_the_formula_knows_liger_s_fused_cross_entropy_in_the_trainer():
    """Liger's fused linear cross-entropy keeps no (T, V) logits: the formula drops them (15.2 GiB -> 8.3
    GiB for Qwen2.5-0.5B, Trainer, bf16-autocast, B=4, L=1024); the simulator runs Liger's kernels too
    (6.86 GiB): what the formula still over-counts is Liger's leaner RMSNorm, RoPE and SwiGLU."""
    run = dict(config=qwen_config(), batch=4, seq=1024, precision="bf16-autocast", client="trainer",
               checkpointing=False, liger_kernel=True, coefficients=COEFFICIENTS)
    formula = estimate(method="formula", **run)
    plain = estimate(method="formula", **{**run, "liger_kernel": False})
    exact = estimate(method="exact", **run)
    assert formula["peak_bytes"] / 2**30 == pytest.approx(8.32, abs=0.01)
    assert plain["peak_bytes"] / 2**30 == pytest.approx(15.17, abs=0.01)
    assert 1.0 < formula["peak_bytes"] / exact["peak_bytes"] < 1.25
    assert any("models its fused linear cross-entropy" in note for note in formula["notes"])


def test_searches_take_the_sft_options(tmp_path):
    path = write(tmp_path / "sft.yaml", SFT_YAML)
    largest = max_batch_size(sft_config=path, seq=1024, gpu_memory_gib=8, method="formula", coefficients=COEFFICIENTS)
    assert largest > 4
    longest = max_seq_len(sft_config=path, batch=4, gpu_memory_gib=8, method="formula", coefficients=COEFFICIENTS)
    assert 1024 < longest < 2**24


@pytest.mark.parametrize("content, message", [
    ("per_device_train_batch_size: 4\ngradient_checkpointing: 'yes'\n", "gradient_checkpointing must be true or false, not 'yes'"),
    ("per_device_train_batch_size: 4\nbf16: true\nfp16: true\n", "bf16 and fp16 are both true"),
    ("per_device_train_batch_size: 0\n", "per_device_train_batch_size must be a positive integer, not 0"),
    ("per_device_train_batch_size: 4\ndtype: float16\n", "dtype 'float16' is not one of bfloat16, float32, auto"),
    ("per_device_train_batch_size: 4\nload_in_4bit: true\n", "a quantized base (load_in_4bit / load_in_8bit) trains adapters only"),
    ("per_device_train_batch_size: 4\nuse_peft: true\nlora_r: -2\n", "lora_r must be a positive integer, not -2"),
    ("- a\n- list\n", "not an SFT config"),
    ("key: [unclosed\n", "not YAML or JSON"),
])
def test_bad_sft_config_is_one_line_and_exit_2(content, message, tmp_path, capsys):
    path = write(tmp_path / "sft.yaml", content)
    code = main(["estimate", "--model", QWEN, "--sft-config", str(path), "--method", "formula"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and message in err and err.count("\n") == 1


@pytest.mark.parametrize("args, message", [
    (["--client", "sft", "--completion-share", "1.5"], "argument --completion-share: '1.5' is not a number in (0, 1]"),
    (["--client", "trainer", "--precision", "bf16", "--completion-share", "0.5"],
     "completion_share is TRL's trainers' (sft, dpo), not the trainer client's"),
    (["--precision", "bf16", "--liger-kernel"],
     "liger_kernel is use_liger_kernel of the Trainer clients (trainer, sft, dpo, grpo, rloo), not of the loop client"),
    (["--client", "sft", "--precision", "amp-bf16", "--weights-dtype", "bf16"],
     "precision amp-bf16 has fp32 weights, not the weights dtype bf16"),
    (["--client", "sft", "--weights-dtype", "fp16"], "argument --weights-dtype: invalid choice"),
    (["--client", "sft", "--sft-config", "missing.yaml"], "missing.yaml: sft config not found"),
    (["--client", "sft", "--training-args", "a.json", "--sft-config", "b.yaml"], "give one training file: training arguments"),
])
def test_bad_sft_options_are_one_line_and_exit_2(args, message, capsys):
    try:
        code = main(["estimate", "--model", QWEN, "--batch", "2", "--seq", "64", "--method", "formula", *args])
    except SystemExit as exc:  # argparse's own one-line errors
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") <= 2  # argparse adds its usage line


@pytest.mark.parametrize("options, message", [
    (dict(client="sft", liger_kernel="yes"), "liger_kernel must be true or false, not 'yes'"),
    (dict(client="sft", completion_share=2), "completion_share must be a number in (0, 1], not 2"),
    (dict(client="sft", weights_dtype="fp16"), "weights dtype 'fp16' is not one of bf16, fp32"),
    (dict(sft_config=123), "sft_config must be a path of a YAML or JSON file or its dict, not int"),
    (dict(client="sft", checkpointing="no"), "checkpointing must be true or false, not 'no'"),
])
def test_bad_python_options_raise_one_line_user_errors(options, message):
    with pytest.raises(UserError) as info:
        estimate(config=qwen_config(), batch=2, seq=64, method="formula", coefficients=COEFFICIENTS, **options)
    assert str(info.value) == message or str(info.value).startswith(message)


def test_no_model_anywhere_is_one_line(tmp_path, capsys):
    path = write(tmp_path / "sft.yaml", "per_device_train_batch_size: 4\n")
    assert main(["estimate", "--seq", "64", "--method", "formula"]) == 2
    assert "give one of --model, --config and --params" in capsys.readouterr().err
    assert main(["estimate", "--sft-config", str(path), "--method", "formula"]) == 2
    assert "sft config: no model_name_or_path (the file names no model; give --model)" in capsys.readouterr().err


def test_the_fit_gives_bf16_autocast_a_group_of_its_own_once_measured():
    """Measured bf16-autocast rows (here: the committed H200 bf16 rows relabelled, as if measured) form a
    peak group of their own in the fit; the formula then uses it, not bf16's stand-in."""
    import pandas as pd

    from pipeline.fit.formula import model_features
    from pipeline.fit.peak import fit_peak, peak_table
    from pipeline.formulas.peak import closed_form_peak

    peaks = pd.read_parquet(REPO / "results/peak_memory.parquet")
    peaks = peaks[(peaks["precision"] == "bf16") & ~peaks["gradient_checkpointing"].fillna(False).astype(bool)]
    facts = model_features(read_config_records(REPO / "results/configs.json"))
    fits = fit_peak(peak_table(peaks.assign(precision="bf16-autocast"), facts), facts, resamples=5)
    assert list(fits) == ["bf16-autocast"]
    from pipeline.formulas.features import read_facts

    qwen = read_facts(qwen_config())
    own = closed_form_peak(fits, qwen, 494_032_768, 4, 1024, "bf16-autocast", "adamw", False)
    assert own["notes"] == [] and own["peak_bytes"] > 0
    with pytest.raises(KeyError):
        closed_form_peak(fits, qwen, 494_032_768, 4, 1024, "bf16-autocast", "adamw", True)  # no checkpointing group
