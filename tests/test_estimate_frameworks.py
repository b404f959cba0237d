"""The frameworks' files (issue 36, first part): an Axolotl config and a LLaMA-Factory config read as the run
they launch (pipeline.estimate.frameworks), answered as the same run asked with explicit options, and the keys
that change memory in ways not simulated yet refused in one line naming them. The files under
tests/data/frameworks/ are written in the shape of the frameworks' documented examples."""

from __future__ import annotations

import pytest
from conftest import REPO

from pipeline.core.errors import UserError
from pipeline.estimate.api import make_run

FILES = REPO / "tests" / "data" / "frameworks"


def test_an_axolotl_qlora_fsdp_recipe_is_its_run():
    run, notes = make_run(axolotl_config=str(FILES / "axolotl_qlora_fsdp.yaml"), num_gpus=2)
    assert (run.client, run.batch, run.seq, run.gradient_accumulation, run.precision, run.checkpointing, run.optim) \
        == ("trainer", 1, 512, 4, "bf16-autocast", True, "adamw_torch")
    assert (run.adapter.r, run.adapter.alpha, run.adapter.targets, run.adapter.quantization) == \
        (8, 16, "all-linear", "nf4")
    assert run.sharding == "fsdp" and run.num_gpus == 2
    assert run.hyperparameters.warmup_steps == 10 and run.hyperparameters.lr_scheduler_type == "cosine"
    assert any("FlashAttention-2" in n for n in notes) and any("FSDP version 1" in n for n in notes)


def test_a_llamafactory_qlora_example_is_its_run():
    run, _ = make_run(llamafactory_config=str(FILES / "llamafactory_qlora_sft.yaml"))
    assert (run.client, run.batch, run.seq, run.gradient_accumulation, run.precision, run.checkpointing) == \
        ("trainer", 1, 2048, 8, "bf16-autocast", True)  # LLaMA-Factory checkpoints unless disabled
    assert (run.adapter.r, run.adapter.alpha, run.adapter.targets, run.adapter.quantization) == \
        (8, 16, "all-linear", "nf4")
    assert run.hyperparameters.warmup_steps == 0.1  # warmup_ratio: below 1, the share of the steps
    dpo, _ = make_run(llamafactory_config=str(FILES / "llamafactory_full_dpo.yaml"))
    assert (dpo.client, dpo.batch, dpo.seq, dpo.adapter) == ("dpo", 2, 512, None)


def test_an_axolotl_file_answers_as_its_explicit_options():
    """Qwen2.5-0.5B, LoRA r=16 on the attention projections, Liger's plugin, micro batch 2 of 1,024 tokens, K=2:
    the file's answer is the explicit question's, peak and reserved."""
    from pipeline.estimate import estimate

    from_file = estimate(axolotl_config=str(FILES / "axolotl_lora.yaml"), method="exact", gpu="RTX 4090")
    explicit = estimate("Qwen/Qwen2.5-0.5B", client="trainer", batch=2, seq=1024, gradient_accumulation=2,
                        precision="bf16-autocast", checkpointing=True, optim="adamw_torch_fused", lora_r=16,
                        lora_alpha=32, lora_targets="q_proj,k_proj,v_proj,o_proj", liger_kernel=True,
                        method="exact", gpu="RTX 4090")
    assert from_file["model_id"] == "Qwen/Qwen2.5-0.5B" and from_file["liger_kernel"]
    assert from_file["peak_bytes"] == explicit["peak_bytes"] > 0
    assert from_file["peak_reserved_bytes"] == explicit["peak_reserved_bytes"] and from_file["fits"]


@pytest.mark.parametrize("kind, changes, words", [
    ("axolotl", {"reward_model": True}, "reward_model is set: a reward model"),
    ("axolotl", {"processor_type": "AutoProcessor"}, "processor_type is set: a vision-language fine-tune"),
    ("axolotl", {"rl": "kto"}, "rl 'kto' is not simulated"),
    ("axolotl", {"plugins": ["axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin"]}, "plugins"),
    ("axolotl", {"fsdp_config": {"fsdp_offload_params": True}}, "fsdp_offload_params with FSDP version 1"),
    ("axolotl", {"adapter": "ia3"}, "adapter 'ia3' is not simulated"),
    ("axolotl", {"gradient_checkpointing": "offload"}, "gradient_checkpointing: offload"),
    ("axolotl", {"xformers_attention": True, "flash_attention": False}, "xformers_attention"),
    ("llamafactory", {"do_train": None, "do_predict": True}, "not a training config (no do_train: true)"),
    ("llamafactory", {"image_max_pixels": 262144}, "image_max_pixels is set: a vision-language fine-tune"),
    ("llamafactory", {"use_muon": True}, "use_muon is set: Muon is not simulated"),
    ("llamafactory", {"pipeline_model_parallel_size": 4}, "Megatron's parallelism"),
    ("axolotl", {"optimizer": "adamw_torch_4bit"}, "optim adamw_torch_4bit is not simulated"),
    ("llamafactory", {"neat_packing": True}, "neat_packing without flash_attn fa2"),
    ("llamafactory", {"stage": "kto"}, "stage 'kto' is not simulated"),
    ("llamafactory", {"finetuning_type": "freeze"}, "finetuning_type 'freeze'"),
    ("llamafactory", {"quantization_bit": 2, "quantization_method": "hqq"}, "quantization_method 'hqq'"),
    ("llamafactory", {"use_galore": True}, "use_galore is set"),
    ("llamafactory", {"bf16": "yes"}, "bf16 and fp16 must be true, false or auto"),
    ("axolotl", {"rl": ["dpo"]}, "rl must be a text"),
    ("axolotl", {"fsdp_config": ["full_shard"]}, "fsdp_config must be a mapping"),
    ("axolotl", {"rl": "grpo", "trl": "fast"}, "trl must be a mapping"),
    ("axolotl", {"lora_r": "eight"}, "lora_r must be a whole number"),
    ("llamafactory", {"stage": ["sft"]}, "stage must be a text"),
    ("llamafactory", {"quantization_bit": {"bits": 4}}, "quantization_bit must be a whole number"),
])
def test_keys_not_simulated_are_refused_in_one_line(kind, changes, words):
    import yaml

    name = "axolotl_lora.yaml" if kind == "axolotl" else "llamafactory_qlora_sft.yaml"
    config = {**yaml.safe_load((FILES / name).read_text()), **changes}
    with pytest.raises(UserError, match=None) as error:
        make_run(**{f"{kind}_config": config})
    assert words in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("kind, packing", [("axolotl", {"sample_packing": True, "pad_to_sequence_len": True}),
                                           ("llamafactory", {"stage": "pt"}), ("llamafactory", {"packing": True})])
def test_packing_is_answered_as_full_rows_with_a_note(kind, packing):
    """Packing fills every row with tokens (Axolotl's multipack, LLaMA-Factory's packing and its pt stage's default):
    the answer is the full rows' step, with a note saying so; the same numbers as the unpacked file at its length."""
    import yaml

    from pipeline.estimate import estimate

    name = "axolotl_lora.yaml" if kind == "axolotl" else "llamafactory_qlora_sft.yaml"
    config = yaml.safe_load((FILES / name).read_text())
    packed = estimate(**{f"{kind}_config": {**config, **packing}}, gpu="RTX 4090")
    plain = estimate(**{f"{kind}_config": config}, gpu="RTX 4090")
    assert packed["peak_bytes"] == plain["peak_bytes"] > 0
    assert any("every row full (packing fills them)" in note for note in packed["notes"])
    assert not any("packing" in note for note in plain["notes"])


def test_numbers_as_yaml_1_1_writes_them_and_the_frameworks_optimizer_names():
    """`learning_rate: 5e-5` is a string to PyYAML and a float to the frameworks' parsers; bitsandbytes' paged
    optimizers by Axolotl's names are answered as the optimizers whose states they hold, with a note."""
    import yaml

    config = yaml.safe_load((FILES / "axolotl_lora.yaml").read_text())
    run, notes = make_run(axolotl_config={**yaml.safe_load("learning_rate: 5e-5"), **{
        k: v for k, v in config.items() if k != "learning_rate"}, "optimizer": "paged_adamw_8bit"})
    assert run.hyperparameters.learning_rate == 5e-5 and run.optim == "adamw_bnb_8bit"
    run, _ = make_run(axolotl_config={**config, "max_steps": "100"})  # a quoted whole number stays whole
    assert run.hyperparameters.max_steps == 100
    assert any("optim paged_adamw_8bit is answered as adamw_bnb_8bit" in note for note in notes)


def test_axolotls_qlora_fsdp_recipe_is_answered_per_gpu(tmp_path):
    """Axolotl's QLoRA + FSDP recipe on 2 GPUs (issue 36): the run it launches, simulated as transformers and
    accelerate run it (the nf4 base stored in bfloat16 and sharded by FSDP2, after each rank loaded the whole 4-bit
    model): Llama-3.1-8B, 1 x 512 tokens, K=4, per RTX 4090: 6.94 GiB, 14.33 GiB reserved (the load's segments
    among them), fits."""
    from conftest import pipeline

    result = pipeline("estimate", "--axolotl-config", FILES / "axolotl_qlora_fsdp.yaml", "--num-gpus", 2, "--method",
                      "exact", "--gpu", "RTX 4090", cwd=tmp_path)
    assert "exact: 6.94 GiB peak for N = 8,030,261,248 at B=1, L=512" in result.stdout
    assert "one GPU of 2 GPUs, fsdp, LoRA r=8 on all-linear (nf4 base)" in result.stdout
    assert "peak reserved                 14.33 GiB" in result.stdout
    assert "fits RTX 4090 (24.0 GiB; reserved + 2.18 GiB outside PyTorch): yes" in result.stdout
    assert "the 4-bit base is stored in bfloat16 (bnb_4bit_quant_storage)" in result.stdout