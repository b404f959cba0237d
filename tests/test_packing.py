"""Packed and padding-free SFTTrainer batches (pipeline.training.packing): TRL's own packing reproduced for a dataset's
worst step, the packed step simulated byte for byte as a real CPU run of the same code, the packed-sequence mask
that torch's SDPA gets, the measured H200 points, and the one-line refusals."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from conftest import TINY_LLAMA, pipeline

from pipeline.cli import main
from pipeline.core.errors import UserError
from pipeline.estimate import estimate
from pipeline.training.packing import Packing, packed_rows, read_lengths, worst_step

pytest.importorskip("trl")

REPO = Path(__file__).resolve().parents[1]
SMOL = "HuggingFaceTB/SmolLM2-135M"


@pytest.mark.parametrize("seed, count, longest, seq", [(0, 2000, 3000, 2048), (1, 2500, 500, 1024), (2, 300, 9000, 4096)])
def test_the_rows_are_those_trl_packs(seed, count, longest, seq):
    import datasets
    from trl.data_utils import pack_dataset

    datasets.disable_progress_bars()
    generator = random.Random(seed)
    lengths = [generator.randint(1, longest) for _ in range(count)]
    packed = pack_dataset(datasets.Dataset.from_dict({"input_ids": [[0] * n for n in lengths]}), seq, "bfd")
    assert sorted(map(sorted, packed["seq_lengths"])) == sorted(map(sorted, packed_rows(lengths, seq)))


def test_the_worst_step_is_the_fullest_rows_or_the_longest_documents():
    lengths = [900, 800, 700, 600, 500, 300, 100, 3000]  # 3000 truncated to 1024
    rows = packed_rows(lengths, 1024)
    fullest = sorted(map(sum, rows), reverse=True)
    packed = worst_step(lengths, 2, 1024, Packing(True))
    assert packed.tokens == fullest[0] + fullest[1] and packed.seq == -(-packed.tokens // 2)
    assert packed.packing == Packing(True, True)
    free = worst_step(lengths, 2, 1024, Packing(False, True))  # TRL runs it without max_length: untruncated
    assert (free.tokens, free.seq, free.packing) == (3000 + 900, 1950, Packing(False, True))
    padded = worst_step(lengths, 3, 1024, None)
    assert (padded.tokens, padded.seq, padded.packing) == (3 * 1024, 1024, None)
    lone = worst_step([700], 1, 1024, Packing(True))  # one row of one document: no packed-sequence mask
    assert (lone.tokens, lone.seq, lone.packing.documents, lone.batch) == (700, 700, (700,), 1)
    tie = worst_step([300, 128, 128], 1, 256, Packing(True))  # two full rows: the one of two documents is the worse
    assert (tie.tokens, tie.packing.documents) == (256, None)
    few = worst_step([5, 7], 8, 256, Packing(True))  # fewer rows than the batch: the step has them only
    assert (few.batch, few.tokens) == (1, 12)


def run_sft(device: str, attention: str, packing: Packing | None, checkpointing: bool = True, batch: int = 2,
            seq: int = 24) -> dict:
    import datasets
    import torch

    from pipeline.inputs.configs import config_from_dict
    from pipeline.inputs.modeling import build
    from pipeline.simulate.clients.sft import SFTRun, meta_sft_trainer
    from pipeline.simulate.clients.trainer import simulate_run
    from pipeline.training.step import Setting

    datasets.disable_progress_bars()
    torch.manual_seed(0)
    model = build(config_from_dict(TINY_LLAMA), "bf16-autocast", attention, device=device)
    setting = Setting(client="sft", gradient_checkpointing=checkpointing, packing=packing)
    trainer = meta_sft_trainer(model, setting, "bf16-autocast", batch, seq, device)
    run = SFTRun(trainer, seq, "bf16-autocast", checkpointing, device)
    first = run.micro_batch()
    run.row = 0
    positions = first.get("position_ids")
    return {**simulate_run(run), "shape": tuple(first["input_ids"].shape),
            "position_ids": None if positions is None else getattr(positions, "_shadow", positions).tolist()}


@pytest.mark.parametrize("packing", [Packing(True), Packing(False, True)])
def test_a_packed_step_on_meta_is_the_cpu_run_byte_for_byte(packing):
    real, simulated = run_sft("cpu", "eager", packing), run_sft("meta", "eager", packing)
    assert real["shape"] == simulated["shape"] == (1, 48)  # two rows of 24 tokens concatenated
    restarts = 4 if packing.packing else 2  # each packed row holds two documents
    assert simulated["position_ids"][0].count(0) == restarts
    for key in ("phase_peaks", "peak_bytes", "components", "peak_reserved_bytes"):
        assert simulated[key] == real[key], key


def test_sdpa_gets_a_packed_sequence_mask_that_each_layer_keeps():
    """Concatenated rows make transformers build a (1, 1, N, N) boolean mask for SDPA, which CUDA's kernel takes as
    an additive (N, N) bias of the compute dtype that each layer saves for its backward (the H200 shows it:
    results/packing)."""
    batch, seq = 2, 256
    tokens = batch * seq
    packed = run_sft("meta", "sdpa", Packing(True), checkpointing=False, batch=batch, seq=seq)
    plain = run_sft("meta", "sdpa", None, checkpointing=False, batch=batch, seq=seq)
    layers = TINY_LLAMA["num_hidden_layers"]
    extra = packed["peak_bytes"] - plain["peak_bytes"]
    assert layers * 2 * tokens ** 2 <= extra < (layers * 2 + 2) * tokens ** 2  # the bool mask too, while it lives


def measured_packing_rows():
    import pandas as pd

    frame = pd.read_parquet(REPO / "results" / "settings_validation.parquet")
    return frame[frame["packing"].notna() & (frame["estimator"] == "exact")]


def test_every_measured_packed_point_is_answered_exactly():
    rows = measured_packing_rows()
    several = rows[rows["num_gpus"] > 1]  # FSDP2, ZeRO-3 and DDP on 2 H200s, each rank a row
    assert len(several) == 6 and set(several["sharding"]) == {"fsdp", "zero3", "ddp"}
    assert several["relative_error"].abs().max() < 0.001 and several["reserved_relative_error"].abs().max() < 0.05
    rows = rows[rows["num_gpus"] == 1]
    assert len(rows) == 15 and set(rows["split"]) == {"tuned", "held-out"}  # and one unpacked point beside them
    ok = rows[rows["status"] == "ok"]
    assert ok["relative_error"].abs().max() < 0.002
    held_out = ok[ok["split"] == "held-out"]
    assert len(held_out) == 9 and held_out["relative_error"].abs().median() < 0.001
    assert held_out["reserved_relative_error"].abs().max() < 0.06
    assert (rows["status"] == "oom").sum() == 2
    # the verdict misses the two points within 0.3 GiB of the H200's edge (Qwen2.5-3B packed: 2 x 9,578 ran out of
    # memory where 0.19 GiB were to spare, 2 x 9,728 trained where the replay's segments did not fit): the replay's
    # fragmentation differs from the GPU's there (docs/packing.md)
    misses = rows[rows["fits_measured"] != rows["fits_predicted_reserved"]]
    assert sorted(misses["seq_len"]) == [9578, 9728]


def test_a_held_out_packed_point_re_simulated_is_its_h200_peak():
    """Qwen2.5-0.5B, four packed rows of 1,800 tokens (a dataset's worst step at max_length 2,048): the measured
    row of results/packing_heldout, simulated here from its own columns."""
    import pandas as pd

    from pipeline.estimate.estimators import ExactEstimator
    from pipeline.estimate.targets import resolve_target
    from pipeline.validate.settings import run_of

    frame = pd.read_parquet(REPO / "results" / "packing_heldout" / "h200" / "peak_memory.parquet")
    row = frame[(frame["model_id"] == "Qwen/Qwen2.5-0.5B") & (frame["seq_len"] == 1800)].iloc[0]
    row = row.to_dict() | {"first_in_process": True}
    run = run_of(pd.Series(row))
    assert run.packing == Packing(True, True) and run.batch == 4
    predicted = ExactEstimator.load(None).predict(resolve_target(row["model_id"], None, None, "exact"), run)
    assert abs(predicted.peak_bytes / row["peak_allocated_bytes"] - 1) < 0.001


def test_the_answer_adds_the_worst_step_of_a_dataset(tmp_path, capsys):
    path = tmp_path / "lengths.jsonl"
    path.write_text("".join(json.dumps({"input_ids": [0] * n}) + "\n" for n in (300, 200, 120, 80, 60)))
    assert read_lengths(path) == [300, 200, 120, 80, 60]
    code = main(["estimate", "--model", SMOL, "--client", "sft", "--batch", "2", "--seq", "256", "--packing",
                 "--lengths", str(path), "--gpu", "H100 80GB", "--json"])
    answer = json.loads(capsys.readouterr().out)
    assert code == 0 and answer["method"] == "exact" and answer["packing"] and answer["padding_free"]
    worst = answer["worst_step"]
    # rows 256 (300 truncated), 200, 120 + 80, 60: the fullest two, as rows of 228 tokens
    assert (worst["tokens"], worst["seq_len"], worst["documents"]) == (456, 228, 5)
    assert worst["peak_bytes"] <= answer["peak_bytes"] and worst["fits"]


@pytest.mark.parametrize("options, message", [
    (dict(client="trainer", precision="bf16", packing=True), "packing and padding_free are TRL's SFTTrainer's"),
    (dict(client="sft", packing="yes"), "packing: packing must be true or false, not 'yes'"),
    (dict(client="sft", packing=True, lengths=[]), "lengths must list from 1 to"),
    (dict(client="sft", packing=True, lengths=[100, 0]), "lengths: every token count must be a whole number from 1"),
])
def test_bad_packing_options_are_one_line(options, message):
    with pytest.raises(UserError) as info:
        estimate(SMOL, batch=2, seq=64, method="formula", **options)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_padding_free_without_packing_in_a_file_is_the_crash_trl_makes(tmp_path, capsys):
    path = tmp_path / "sft.yaml"
    path.write_text(f"model_name_or_path: {SMOL}\nper_device_train_batch_size: 2\npadding_free: true\n")
    code = main(["estimate", "--sft-config", str(path), "--seq", "128", "--method", "formula"])
    err = capsys.readouterr().err
    assert code == 2 and "TRL refuses padding_free without packing when max_length is set" in err
    assert err.count("\n") == 1


@pytest.mark.parametrize("sharding", ["fsdp", "zero3"])
def test_packed_batches_on_several_gpus_count_the_mask_on_each(sharding):
    """Each rank concatenates its own micro-batch; TRL gathers the ranks' token counts for its log (every rank's
    the same here)."""
    config = dict(TINY_LLAMA, max_position_embeddings=1024)
    common = dict(config=config, client="sft", batch=2, seq=256, precision="bf16-autocast", checkpointing=False,
                  num_gpus=2, sharding=sharding, method="exact")
    packed, plain = estimate(packing=True, **common), estimate(**common)
    tokens = 2 * 256
    extra = packed["peak_bytes"] - plain["peak_bytes"]
    assert packed["padding_free"] and 2 * 2 * tokens ** 2 <= extra < 6 * tokens ** 2


def test_a_dataset_file_is_tokenized_as_sfttrainer_does(tmp_path, capsys):
    """A local JSONL with plain text and prompt-completion rows, and a tokenizer's folder (the project's word-level
    tokenizer, saved as a Hub tokenizer is): each text ends with the eos token, as SFTTrainer adds it."""
    from pipeline.training.dataset_lengths import dataset_lengths
    from pipeline.training.sft import tokenizer

    folder = tmp_path / "tokenizer"
    tokenizer(4096).save_pretrained(folder)
    rows = [{"text": " ".join(f"t{i}" for i in range(5, 305))}, {"text": "t7 t8 t1"},
            {"prompt": "t9 t10 t11", "completion": " t12 t13"}]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(folder)
    count = lambda text: len(loaded(text=text)["input_ids"])  # noqa: E731
    expected = [count(rows[0]["text"] + "t1"), count("t7 t8 t1"), count("t9 t10 t11 t12 t13t1")]
    assert expected[1] == 3 and expected[0] > 300
    assert dataset_lengths(str(path), str(folder)) == expected  # the eos added where the text lacks it
    code = main(["estimate", "--model", SMOL, "--client", "sft", "--batch", "1", "--seq", "256", "--padding-free",
                 "--dataset", str(path), "--tokenizer", str(folder), "--method", "formula", "--json"])
    answer = json.loads(capsys.readouterr().out)
    assert code == 0 and answer["worst_step"]["documents"] == 3
    assert answer["worst_step"]["tokens"] == expected[0]  # padding-free alone: the longest document, untruncated
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "t5"}]}) + "\n")
    code = main(["estimate", "--model", SMOL, "--client", "sft", "--batch", "1", "--seq", "256", "--packing",
                 "--dataset", str(chat), "--tokenizer", str(folder), "--method", "formula"])
    err = capsys.readouterr().err
    assert code == 2 and "row 1: the chat template cannot be applied" in err and err.count("\n") == 1


@pytest.mark.parametrize("args, message", [
    (["--dataset", "missing.jsonl"], "dataset missing.jsonl: file not found"),
    (["--dataset", "org/not-a-dataset-here"], "dataset org/not-a-dataset-here: cannot be loaded"),
    (["--lengths", "missing.txt"], "lengths file missing.txt: cannot be read"),
    (["--tokenizer", "x"], "tokenizer goes with a dataset"),
])
def test_a_dataset_that_cannot_be_read_is_one_line(args, message, tmp_path):
    """Offline, as here: a Hub dataset cannot be fetched (a command of its own: the Hub's offline switch is read
    when its library is imported)."""
    result = pipeline("estimate", "--model", SMOL, "--client", "sft", "--batch", "1", "--seq", "256", "--packing",
                      "--method", "formula", *args, cwd=tmp_path, check=False)
    assert result.returncode == 2 and message in result.stderr and result.stderr.count("\n") == 1, result.stderr
