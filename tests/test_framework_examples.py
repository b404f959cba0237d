"""Every example config of Axolotl's and LLaMA-Factory's example folders (issue 36), kept in
tests/data/frameworks/examples (tests/data/frameworks/examples/SOURCE.md: the repositories, commits and license), is
either read as the run it launches, its model known offline, or refused in one line that names the key (or the model
or the missing key) it turns on. A file that shards (FSDP, DeepSpeed) is asked with --num-gpus 2, as its launch
would be."""

from __future__ import annotations

import collections

import pytest
import yaml

from conftest import REPO
from pipeline.core.errors import UserError
from pipeline.estimate.api import default_method, make_run, model_of_file
from pipeline.inputs.records import model_record

EXAMPLES = REPO / "tests" / "data" / "frameworks" / "examples"
FRAMEWORKS = {"axolotl": EXAMPLES / "axolotl" / "examples", "llamafactory": EXAMPLES / "llamafactory" / "examples"}
ABSENT_KEYS = ("do_train", "base_model", "model_name_or_path", "per_device_train_batch_size")


def run_of(kind: str, path) -> tuple:
    """make_run of the file, asked with --num-gpus 2 when it shards."""
    option = {f"{kind}_config": str(path)}
    try:
        return make_run(**option)
    except UserError as error:
        if "number of GPUs" not in str(error):
            raise
        return make_run(**option, num_gpus=2)


def outcome(kind: str, path) -> str:
    """"answered", or the refusal's one line."""
    option = {f"{kind}_config": str(path)}
    try:
        run_of(kind, path)
        model, _ = model_of_file(None, None, None, option)
        model_record(model, None, REPO / "results" / "configs.json")
    except UserError as error:
        return str(error)
    return "answered"


def names_what_it_refuses(message: str, path) -> bool:
    message = message.replace(str(path), "")  # the file's own path names nothing it asks for
    keys = yaml.safe_load(path.read_text()) or {}
    values = [v for v in keys.values() if isinstance(v, str)]
    return any(str(k) in message for k in [*keys, *values, *ABSENT_KEYS])


@pytest.fixture(scope="module")
def walked(monkeypatch_module):
    monkeypatch_module.setenv("HF_HUB_OFFLINE", "1")
    return {kind: {path: outcome(kind, path) for path in sorted(folder.rglob("*.y*ml"))}
            for kind, folder in FRAMEWORKS.items()}


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_every_example_is_answered_or_refused_in_one_line_naming_the_key(walked):
    for kind, outcomes in walked.items():
        for path, message in outcomes.items():
            assert "\n" not in message, (path, message)
            assert message == "answered" or names_what_it_refuses(message, path), (path, message)


def test_the_walk_covers_both_folders_as_copied(walked):
    """252 Axolotl YAMLs and 85 LLaMA-Factory ones (SOURCE.md); how many are answered offline today (models in the
    registry; the rest refused: Cut Cross-Entropy's plugin, vision, offloading, xformers and flex attention, QAT, ...
    and models not embedded)."""
    counts = {kind: collections.Counter("answered" if m == "answered" else "refused" for m in outcomes.values())
              for kind, outcomes in walked.items()}
    assert counts == {"axolotl": {"answered": 42, "refused": 210}, "llamafactory": {"answered": 12, "refused": 73}}


def test_keys_that_change_memory_are_named(walked):
    """Axolotl's attn_implementation: flash attention answered with SDPA's flash path (said), eager read as eager,
    xformers refused; LoRA dropout read (PEFT's dropout copies each adapted layer's input: simulated)."""
    run, notes = make_run(axolotl_config={"base_model": "Qwen/Qwen2.5-0.5B", "adapter": "lora", "lora_r": 8,
                                          "lora_target_linear": True, "lora_dropout": 0.05, "sequence_len": 512,
                                          "attn_implementation": "eager"})
    assert run.attn_implementation == "eager" and run.batch == 1  # Axolotl's default micro_batch_size
    assert default_method(run) == "exact"  # the heuristic's line is full fine-tuning's with SDPA
    sdpa, _ = make_run(axolotl_config={"base_model": "Qwen/Qwen2.5-0.5B", "sequence_len": 512})
    assert default_method(sdpa) == "heuristic"
    assert run.adapter.dropout == 0.05 and not any("dropout" in note for note in notes)
    assert any("micro_batch_size not set: Axolotl's default, 1" in note for note in notes)
    flash = [p for p, m in walked["axolotl"].items()
             if m == "answered" and "attn_implementation: flash_attention_2" in p.read_text()]
    _, notes = run_of("axolotl", flash[0])
    assert any("attn_implementation flash_attention_2 is answered with torch's SDPA flash path" in n for n in notes)
    xformers = [m for p, m in walked["axolotl"].items() if "attn_implementation 'xformers'" in m]
    assert len(xformers) == 7 and all(m.endswith("is not simulated (sdpa, eager and flash attention are)")
                                      for m in xformers)


def test_deepspeed_files_resolve_from_the_repository_root(walked):
    """LLaMA-Factory's `deepspeed: examples/deepspeed/ds_z3_config.json` and Axolotl's `deepspeed_configs/zero2.json`
    are paths from their repository's root: found from the config file's parent folders, they are read (ZeRO-3 with
    `overlap_comm: false` among them)."""
    run, _ = make_run(llamafactory_config=str(FRAMEWORKS["llamafactory"] / "train_lora" / "qwen3_lora_sft_ds3.yaml"),
                      num_gpus=2)
    assert run.sharding == "zero3" and run.deepspeed is not None and '"overlap_comm":false' in run.deepspeed.replace(" ", "")
    assert not any("DeepSpeed config not found" in m for outcomes in walked.values() for m in outcomes.values())
