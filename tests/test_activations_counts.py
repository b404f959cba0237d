"""The activations stage on real models built from their configs (meta device, and the CPU to check it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.cli import main
from pipeline.core.errors import UserError

REGISTRY = Path(__file__).parent / "data" / "models_small.yaml"
FULL_REGISTRY = Path(__file__).parent.parent / "models.yaml"


def counted(model_id: str, **kwargs) -> dict:
    from pipeline.activations import count

    return count(model=model_id, config_source="embedded", registry=REGISTRY, **kwargs)


def registry_config(model_id: str, registry: Path = REGISTRY):
    from pipeline.inputs.configs import resolve_model

    return resolve_model(model_id, mode="embedded", registry_path=registry).config


def test_qwen25_15b_reproduces_the_blog_figure():
    fp32 = counted("Qwen/Qwen2.5-1.5B")
    assert fp32["parameters"] == 1_543_714_304
    assert fp32["elements_per_token"] == 1_266_304
    assert fp32["bytes_per_token"] == 5_065_216  # the blog's "5,065,216 activations": fp32 bytes
    assert fp32["forward"] == "meta"
    assert counted("Qwen/Qwen2.5-1.5B", dtype="bfloat16")["bytes_per_token"] == 2_532_608


@pytest.mark.parametrize("model_id, parameters, embedding, non_embedding, elements", [
    ("openai-community/gpt2", 124_439_808, 39_383_808, 85_056_000, 237_649),  # tied head
    ("EleutherAI/pythia-14m", 14_067_712, 6_438_912, 1_189_888, 66_064),  # untied head
])
def test_small_models_counts(model_id, parameters, embedding, non_embedding, elements):
    result = counted(model_id)
    assert (result["parameters"], result["embedding_parameters"], result["non_embedding_parameters"],
            result["active_parameters"], result["elements_per_token"]) == (
        parameters, embedding, non_embedding, parameters, elements)


def test_meta_hook_count_equals_a_real_cpu_forward():
    import torch

    from pipeline.activations.counts import ModelCounter, hook_elements
    from pipeline.inputs.modeling import build_model

    config = registry_config("EleutherAI/pythia-14m")
    torch.manual_seed(0)
    real = build_model(config, device="cpu")
    on_cpu = hook_elements(real, torch.zeros((1, 1), dtype=torch.int64))
    on_meta = ModelCounter(config).hook(1, 1)
    assert on_meta.forward == "meta"
    assert on_meta.elements == on_cpu == 66_064


def test_saved_for_backward_on_meta_equals_a_real_cpu_training_forward():
    """Same distinct storages with the math attention kernel (the one meta tensors take). The CPU's
    default flash kernel saves the log-sum-exp instead of the attention probabilities: fewer bytes."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from pipeline.activations.counts import ModelCounter, saved_storages
    from pipeline.inputs.modeling import build_model

    config = registry_config("EleutherAI/pythia-14m")
    counter = ModelCounter(config)
    on_meta = counter.saved(1, 64, "float32")
    real = build_model(config, device="cpu")
    ids = counter.input_ids("saved", 1, 64)
    with sdpa_kernel(SDPBackend.MATH):
        math_bytes, math_elements = saved_storages(real, ids)
    flash_bytes, _ = saved_storages(real, ids)
    assert on_meta.forward == "meta-fallback"  # use_cache=False asks a data-dependent question
    assert (on_meta.bytes, on_meta.elements) == (math_bytes, math_elements) == (16_690_700, 4_172_546)
    assert flash_bytes < math_bytes
    with sdpa_kernel(SDPBackend.MATH):  # the CUDA autocast emulation works the same on both devices
        assert saved_storages(real, ids, autocast=True)[0] == counter.saved(1, 64, "amp-bf16").bytes


def test_saved_for_backward_grows_with_sequence_and_precision():
    from pipeline.activations.counts import ModelCounter

    counter = ModelCounter(registry_config("EleutherAI/pythia-14m"))
    fp32 = {seq: counter.saved(1, seq, "float32").bytes / seq for seq in (32, 256)}
    bf16 = counter.saved(1, 32, "bfloat16").bytes / 32
    amp = counter.saved(1, 32, "amp-bf16").bytes / 32
    assert fp32[256] > fp32[32]  # attention probabilities: L^2 per sequence
    assert bf16 < fp32[32]
    assert amp > fp32[32]  # bf16 copies of the weights are saved too (a constant over B*L tokens)


def test_moe_model_counts():
    result = counted("Qwen/Qwen1.5-MoE-A2.7B")
    assert result["parameters"] == 14_315_784_192
    assert result["active_parameters"] == 2_689_173_504  # "A2.7B": 4 of 60 routed experts per token
    assert result["elements_per_token"] == 1_288_440
    assert result["forward"] == "meta"  # fp32 grouped_mm, whose meta kernel wants bf16


def test_moe_architecture_facts():
    from pipeline.inputs.modeling import architecture_facts

    facts = architecture_facts(registry_config("Qwen/Qwen1.5-MoE-A2.7B"))
    assert (facts["num_experts"], facts["num_experts_per_tok"], facts["attention_kind"]) == (60, 4, "mha")
    facts = architecture_facts(registry_config("Qwen/Qwen2.5-1.5B"))
    assert (facts["num_experts"], facts["attention_kind"], facts["head_dim"], facts["num_key_value_heads"]) == (
        None, "gqa", 128, 2)


def test_count_with_batch_and_seq_adds_saved_bytes():
    result = counted("EleutherAI/pythia-14m", batch=1, seq=64)
    assert result["saved_bytes"] == 16_690_700
    assert result["saved_bytes_per_token"] == 16_690_700 / 64
    assert result["saved_forward"] == "meta-fallback"


def test_stage_writes_both_tables(tmp_path, capsys):
    import pandas as pd

    from pipeline.activations.table import ACTIVATION_COLUMNS, MODEL_COLUMNS

    configs = tmp_path / "configs.json"
    assert main(["configs", "--registry", str(REGISTRY), "--out", str(configs), "--source", "embedded"]) == 0
    models_out, activations_out = tmp_path / "models.parquet", tmp_path / "activations.parquet"
    assert main(["activations", "--registry", str(REGISTRY), "--configs", str(configs), "--points", "blog",
                 "--models-out", str(models_out), "--activations-out", str(activations_out)]) == 0
    models, activations = pd.read_parquet(models_out), pd.read_parquet(activations_out)
    provenance = ["torch_version", "transformers_version", "python_version", "git_commit", "device"]
    assert list(models.columns[:len(MODEL_COLUMNS)]) == list(MODEL_COLUMNS)
    assert list(activations.columns[:len(ACTIVATION_COLUMNS)]) == list(ACTIVATION_COLUMNS)
    assert set(provenance) <= set(models.columns) and set(provenance) <= set(activations.columns)
    assert (models["status"] == "ok").all() and len(models) == 6
    assert (models["config_source"] == "embedded").all()
    assert len(activations) == 12  # blog points: hook at (1, 1), float32 and bfloat16 rows
    qwen = activations[(activations["model_id"] == "Qwen/Qwen2.5-1.5B") & (activations["dtype"] == "float32")]
    assert qwen["bytes_per_token"].tolist() == [5_065_216]
    assert "6/6" in capsys.readouterr().err  # progress


def test_a_failing_model_becomes_a_row_and_the_others_go_on(tmp_path):
    import pandas as pd

    from pipeline.activations.stage import write_activations
    from pipeline.inputs.configs import write_configs

    import yaml

    broken = {"id": "test/broken-gpt2", "family": "test", "source": "no model can be built: 10 dimensions, 3 heads",
              "config": {"model_type": "gpt2", "vocab_size": 100, "n_embd": 10, "n_layer": 1, "n_head": 3}}
    registry = tmp_path / "models.yaml"
    registry.write_text(yaml.safe_dump({"models": [broken, *yaml.safe_load(REGISTRY.read_text())["models"]]}))
    write_configs(registry, tmp_path / "configs.json", mode="embedded")
    models, activations = write_activations(registry, tmp_path / "configs.json", tmp_path / "m.parquet",
                                            tmp_path / "a.parquet", workers=1, points="blog")
    broken = models[models["model_id"] == "test/broken-gpt2"].iloc[0]
    # the configs stage's one check refuses it first; its reason reaches the row
    assert broken["status"] == "skipped" and "not a multiple of 3 attention heads" in broken["reason"]
    assert (models[models["model_id"] != "test/broken-gpt2"]["status"] == "ok").all()
    assert len(pd.read_parquet(tmp_path / "m.parquet")) == 7
    assert set(activations["model_id"]) == set(models["model_id"]) - {"test/broken-gpt2"}


def test_configs_skipped_by_the_configs_stage_become_skipped_rows(tmp_path):
    import json

    from pipeline.activations.stage import read_jobs
    from pipeline.inputs.configs import write_configs

    configs = tmp_path / "configs.json"
    write_configs(REGISTRY, configs, mode="embedded")
    records = json.loads(configs.read_text())
    records["openai-community/gpt2"].update(status="skipped", reason="needs trust_remote_code", config=None)
    configs.write_text(json.dumps(records))
    jobs = {job.model_id: job for job in read_jobs(REGISTRY, configs)}
    assert jobs["openai-community/gpt2"].config is None
    assert jobs["openai-community/gpt2"].skip_reason == "needs trust_remote_code"


def one_line_error(argv, capsys) -> str:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse errors
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1
    return err


@pytest.mark.parametrize("argv, message", [
    (["count", "--model", "openai-community/gpt2", "--dtype", "float64"], "invalid choice"),
    (["count", "--model", "openai-community/gpt2", "--batch", "0", "--seq", "8"], "must be positive"),
    (["count", "--model", "openai-community/gpt2", "--batch", "2"], "give both --batch and --seq"),
    (["count", "--config", "/nonexistent/config.json"], "config file not found"),
    (["count", "--model", "nobody/unknown-model", "--config-source", "embedded"], "not in the registry"),
])
def test_count_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    assert message in one_line_error([*argv, "--registry", str(REGISTRY), "--json"], capsys)


def test_count_config_with_unknown_model_type(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "no-such-architecture", "hidden_size": 8}')
    assert "unknown model_type" in one_line_error(["count", "--config", str(config)], capsys)
    config.write_text("{not json")
    assert "not a JSON config file" in one_line_error(["count", "--config", str(config)], capsys)


def test_count_function_rejects_bad_arguments():
    from pipeline.activations import count

    with pytest.raises(UserError, match="dtype"):
        count(model="openai-community/gpt2", dtype="int8", registry=REGISTRY)
    with pytest.raises(UserError, match="positive"):
        count(model="openai-community/gpt2", batch=-1, seq=4, registry=REGISTRY)


def test_count_cli_json(capsys):
    import json

    assert main(["count", "--model", "Qwen/Qwen2.5-1.5B", "--config-source", "embedded", "--registry",
                 str(REGISTRY), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert {"parameters", "elements_per_token", "bytes_per_token", "dtype"} <= set(result)
    assert (result["elements_per_token"], result["bytes_per_token"], result["dtype"]) == (1_266_304, 5_065_216,
                                                                                           "float32")


# Layer replay: decoder stacks whose layers differ by position (sliding/global attention, NoPE
# layers, dense-then-MoE, alternating local attention, a recurrent scan), each counted with and
# without replay.
REPLAY_CASES = {  # layers replayed at each of the points below (the rest ran)
    "Qwen/Qwen2.5-0.5B": (22, 22, 21, 21, 21),  # 24 layers
    "google/gemma-3-1b-it": (22, 22, 20, 20, 20),  # 26 layers, 5 sliding : 1 global
    "EleutherAI/gpt-neo-125m": (8, 8, 0, 0, 0),  # 12 layers, global and local alternate
    "deepseek-ai/DeepSeek-V2-Lite": (24, 24, 24, 24, 24),  # 27 layers, a dense first layer, then MoE
    "meta-llama/Llama-4-Scout-17B-16E": (44, 44, 43, 43, 43),  # 48 layers, NoPE every 4th
    "state-spaces/mamba-130m-hf": (22, 22, 22, 21, 22),  # 24 layers, a recurrent scan
}
REPLAY_POINTS = (("hook", (1, 1)), ("hook", (2, 96)), ("saved", (1, 64, "float32")),
                 ("saved", (2, 96, "bfloat16")), ("saved", (1, 64, "amp-bf16")))


@pytest.mark.parametrize("model_id", REPLAY_CASES)
def test_layer_replay_counts_equal_full_forwards(model_id):
    from pipeline.activations.counts import ModelCounter

    config = registry_config(model_id, FULL_REGISTRY)
    replayed, full = ModelCounter(config), ModelCounter(config, replay_layers=False)
    for (method, point), replays in zip(REPLAY_POINTS, REPLAY_CASES[model_id]):
        fast, slow = getattr(replayed, method)(*point), getattr(full, method)(*point)
        assert fast.status == slow.status == "ok", (fast.reason, slow.reason)
        assert (fast.elements, fast.bytes) == (slow.elements, slow.bytes), (method, point)
        assert replayed.last_tally.replayed_layers == replays, (method, point)
        assert full.last_tally.replayed_layers == 0


class SlowingClock:
    """A perf_counter whose every call is 100 s later than the last gap: a machine far slower than any."""

    def __init__(self):
        self.now, self.step = 0.0, 0.0

    def perf_counter(self):
        self.step += 100.0
        self.now += self.step
        return self.now


def test_points_skipped_follow_from_the_model_and_the_point_not_from_timings(monkeypatch):
    """A recurrent scan (mamba) is counted up to SCAN_MAX_SEQ_LEN; attention (gpt2) beyond it; both
    whatever the forwards' times (a clock that slows down at every call)."""
    from types import SimpleNamespace

    from transformers import GPT2Config, MambaConfig

    from pipeline.activations import counts, table
    from pipeline.activations.points import SCAN_MAX_SEQ_LEN, POINT_TIME_LIMIT_S, PointSet
    from pipeline.activations.table import ModelJob, count_model

    clock = SlowingClock()
    for module in (counts, table):
        monkeypatch.setattr(module, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    points = PointSet(hook=((1, 1), (1, 8)), saved=((1, 8), (1, SCAN_MAX_SEQ_LEN + 1)), precisions=("float32",))
    mamba = MambaConfig(vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=3, expand=2)
    gpt2 = GPT2Config(vocab_size=64, n_embd=16, n_layer=3, n_head=2, n_positions=4096)
    statuses = {}
    for model_type, config in (("mamba", mamba), ("gpt2", gpt2)):
        model_row, rows = count_model(ModelJob(f"test/tiny-{model_type}", "test", model_type, config), points)
        assert model_row["status"] == "ok"
        statuses[model_type] = [(r["method"], r["dtype"], r["seq_len"], r["status"], r["reason"]) for r in rows]
        assert all(r["seconds"] > POINT_TIME_LIMIT_S for r in rows if r["status"] == "ok")  # the slow clock ran
    counted = [("hook", "float32", 1, "ok", None), ("hook", "bfloat16", 1, "ok", None),
               ("hook", "float32", 8, "ok", None), ("hook", "bfloat16", 8, "ok", None),
               ("saved", "float32", 8, "ok", None)]
    rule = f"recurrent scan without its CUDA kernels: counted up to L={SCAN_MAX_SEQ_LEN}"
    assert statuses["mamba"] == [*counted, ("saved", "float32", SCAN_MAX_SEQ_LEN + 1, "skipped", rule)]
    assert statuses["gpt2"] == [*counted, ("saved", "float32", SCAN_MAX_SEQ_LEN + 1, "ok", None)]


def test_skip_rule_boundaries():
    from pipeline.activations.points import SCAN_MAX_SEQ_LEN, skip_reason

    assert skip_reason(("mamba", "mamba"), SCAN_MAX_SEQ_LEN, None) is None
    assert "recurrent scan" in skip_reason(("llava", "mamba"), SCAN_MAX_SEQ_LEN + 1, None)  # a wrapped scan model
    assert skip_reason(("llama", "llama"), SCAN_MAX_SEQ_LEN + 1, None) is None
    assert skip_reason(("mamba", "mamba"), 4096, 1024) == "seq_len 4096 beyond the context length 1024"
