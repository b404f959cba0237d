"""`python -m pipeline serve` against a real uvicorn server on localhost: its answers equal
`python -m pipeline estimate ... --json` for the same question (formula and exact, searches, several GPUs,
the layouts table and the fewest GPUs included), bad input is HTTP 400 with one line, the registry and the GPU
catalogue are listed, concurrent questions are not mixed, and the page loads nothing from elsewhere."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import REPO, offline_env
from serve_support import TINY_CONFIG, ask, cli_json, request, running_server, stream

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

SMALL = "HuggingFaceTB/SmolLM2-135M"
GIB = 2**30
# An accelerate config as `accelerate config` writes it (its JSON object: the server reads no paths).
ACCELERATE_FSDP = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP", "num_processes": 4,
                   "mixed_precision": "bf16", "num_machines": 1, "machine_rank": 0, "use_cpu": False,
                   "fsdp_config": {"fsdp_version": 2, "fsdp_reshard_after_forward": True,
                                   "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                                   "fsdp_state_dict_type": "SHARDED_STATE_DICT"}}
# A 13B model in bf16 on H100s: its weights, gradients and AdamW state alone (97 GiB) are over one GPU.
LLAMA_13B = {"model": "meta-llama/Llama-2-13b-hf", "batch": 2, "seq": 2048, "precision": "bf16",
             "checkpointing": True, "gpu": "H100 80GB", "method": "formula"}

FORMULA_QUESTIONS = [
    {"model": SMALL, "batch": 4, "seq": 1024, "precision": "bf16", "gpu": "RTX 4090"},
    {"model": SMALL, "batch": 8, "seq": 1024, "precision": "amp-bf16", "client": "trainer",
     "optim": "adamw_torch_fused", "gradient_accumulation": 4, "checkpointing": True, "gpu": "T4"},
    {"model": "meta-llama/Llama-3.1-8B", "batch": 4, "seq": 4096, "precision": "bf16", "lora_r": 16,
     "quantization": "nf4", "gpu": "RTX 4090"},
    {"model": "meta-llama/Llama-3.1-8B", "batch": 1, "seq": 2048, "precision": "bf16", "num_gpus": 4,
     "sharding": "fsdp", "gpu": "H100 80GB"},
    {"model": "meta-llama/Llama-3.1-8B", "batch": 1, "seq": 4096, "precision": "bf16", "num_gpus": 32,
     "sharding": "hsdp", "shard_group": 8, "tensor_parallel": 2, "gpu": "H100 80GB"},
    {"model": SMALL, "batch": 4, "seq": 1024, "client": "trainer", "weights_dtype": "fp32",
     "accelerate_config": ACCELERATE_FSDP, "gpu": "T4"},
    {"model": SMALL, "batch": 4, "seq": 1024, "weights_dtype": "bf16", "client": "sft", "num_gpus": 2,
     "sharding": "ddp", "gpu": "L4"},
    {**LLAMA_13B, "layouts": True, "num_gpus": 16},
    {"model": SMALL, "batch": 4, "seq": 1024, "client": "trainer", "weights_dtype": "fp32",
     "accelerate_config": ACCELERATE_FSDP, "gpu": "T4", "layouts": True},
    {**LLAMA_13B, "min_gpus": True, "num_gpus": 64},
    {"model": SMALL, "seq": 2048, "precision": "bf16", "gpu_memory_gib": 23.5, "max_batch_size": True},
    {"model": SMALL, "batch": 2, "precision": "fp32", "gpu": "T4", "max_seq_len": True},
    {"config": TINY_CONFIG, "batch": 2, "seq": 128, "precision": "bf16", "gpu": "T4"},
    # the page's words for an SFTTrainer user on bf16 weights (TRL's bf16=True): the command's --weights-dtype
    {"model": SMALL, "batch": 4, "seq": 1024, "weights_dtype": "bf16", "client": "sft", "optim": "adamw_torch_fused",
     "checkpointing": True, "lora_r": 16, "quantization": "nf4", "gpu": "L4"},
]

EXACT_QUESTIONS = [
    {"model": SMALL, "batch": 2, "seq": 256, "precision": "bf16", "gpu": "RTX 4090"},
    {"config": TINY_CONFIG, "batch": 2, "seq": 128, "precision": "bf16", "lora_r": 8, "gpu": "T4"},
    {"config": TINY_CONFIG, "seq": 128, "precision": "bf16", "gpu_memory_gib": 0.5, "max_batch_size": True},
    # the layouts' simulations run in processes the simulator's worker starts
    {"config": TINY_CONFIG, "batch": 2, "seq": 128, "precision": "bf16", "gpu": "T4", "layouts": True, "num_gpus": 2},
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("serve") / "server.log") as url:
        yield url


def answer_of(server, question):
    status, body, _ = ask(server, question)
    assert status == 200, body
    return body


@pytest.mark.parametrize("question", FORMULA_QUESTIONS, ids=lambda q: ",".join(f"{k}" for k in q if k != "method"))
def test_formula_answer_is_the_commands(server, question):
    question = {**question, "method": "formula"}
    assert answer_of(server, question) == cli_json(question)


@pytest.mark.slow
@pytest.mark.parametrize("question", EXACT_QUESTIONS, ids=["registry", "config-lora", "config-max-batch",
                                                           "config-layouts"])
def test_exact_answer_is_the_commands(server, question):
    question = {**question, "method": "exact"}
    assert answer_of(server, question) == cli_json(question)


def test_the_layouts_of_a_13b_model(server):
    """The formula's table on H100s: ddp keeps the whole model on every GPU and fits on none, fsdp fits on two;
    the layouts asked of the question (its sharding) are the table's to vary, as --layouts drops them."""
    question = {**LLAMA_13B, "layouts": True, "num_gpus": 16}
    found = answer_of(server, question)
    assert found == answer_of(server, {**question, "sharding": "hsdp", "shard_group": 8, "tensor_parallel": 2})
    rows = {row["layout"]: row for row in found["layouts"]}
    assert sorted({row["num_gpus"] for row in found["layouts"]}) == [1, 2, 4, 8, 16]
    for ddp in ("1 GPU", "2 GPUs, ddp", "16 GPUs, ddp"):
        assert rows[ddp]["fits"] is False and rows[ddp]["peak_bytes"] is None
        assert rows[ddp]["reason"] == "weights, gradients and optimizer state alone take 97.0 GiB a GPU"
    fsdp = rows["2 GPUs, fsdp"]
    assert fsdp["fits"] is True and fsdp["peak_bytes"] == 65147479040
    assert round(fsdp["headroom_bytes"] / GIB, 2) == 12.78
    assert rows["16 GPUs, hsdp (2 replicas x 8 shards)"]["peak_bytes"] == rows["8 GPUs, fsdp"]["peak_bytes"]
    assert len(found["layouts"]) == 23


def test_the_fewest_gpus_of_a_13b_model(server):
    """Two H100s under fsdp, the command's answer (which searches up to its own limit: the same rows, found at 2);
    without num_gpus the server searches up to its limit of GPUs."""
    question = {key: value for key, value in LLAMA_13B.items()}
    found = answer_of(server, {**question, "min_gpus": True})
    assert found == cli_json({**question, "min_gpus": True}) == cli_json({**question, "min_gpus": True,
                                                                         "num_gpus": 1024})
    assert found["min_gpus"] == 2 and found["layout"]["layout"] == "2 GPUs, fsdp"
    assert [row["num_gpus"] for row in found["layouts"]] == [1, 2, 2, 2, 2]


def test_the_layouts_stream_sends_each_row_as_it_is_answered(server):
    """/api/layouts: the fewest GPUs of the 13B question event by event (each N announced, then its rows), and the
    exact table of a small llama on 1 to 4 GPUs (9 layouts: the loop's hsdp and tensor parallelism too) row by row as its simulations end; the last event's answer is
    /api/estimate's. A question that is not a layouts search is 400 before any line."""
    status, events = stream(server, {**LLAMA_13B, "min_gpus": True})
    assert status == 200 and [e["event"] for e in events] == ["start", "count", "row", "count", "row", "row", "row",
                                                              "row", "end"]
    assert events[0]["layouts"] is None and [e["num_gpus"] for e in events if e["event"] == "count"] == [1, 2]
    assert events[-1]["answer"] == answer_of(server, {**LLAMA_13B, "min_gpus": True})
    assert [e["row"] for e in events if e["event"] == "row"] == events[-1]["answer"]["layouts"]
    question = {"config": TINY_CONFIG, "batch": 2, "seq": 128, "precision": "bf16", "method": "exact", "gpu": "T4",
                "layouts": True, "num_gpus": 4}
    status, events = stream(server, question)
    assert status == 200 and events[0] == {"event": "start", "layouts": 9} and events[-1]["event"] == "end"
    rows = {e["index"]: e["row"] for e in events if e["event"] == "row"}
    assert sorted(rows) == list(range(9)) and [rows[i] for i in range(9)] == events[-1]["answer"]["layouts"]
    assert events[-1]["answer"]["method"] == "exact" and all(row["peak_bytes"] > 0 for row in rows.values())
    assert events[-1]["answer"] == answer_of(server, question)
    status, body = stream(server, {"model": SMALL, "batch": 4, "seq": 1024, "precision": "bf16"})
    assert status == 400 and body["error"].startswith('/api/layouts answers "layouts": true or "min_gpus": true')
    status, body = stream(server, {**LLAMA_13B, "layouts": True, "gpu": "no such GPU"})
    assert status == 400 and "no such GPU" in body["error"]


def test_no_layout_fits_up_to_the_servers_limit(server):
    """A million tokens of a 151k vocabulary per rank: no layout fits a T4 up to the server's 1,024 GPUs."""
    found = answer_of(server, {"model": "Qwen/Qwen2.5-0.5B", "batch": 256, "seq": 4096, "precision": "bf16",
                               "gpu": "T4", "method": "formula", "min_gpus": True})
    assert found["min_gpus"] == 0 and found["layout"] is None
    assert found["layouts"][-1]["num_gpus"] == 1024 and not any(row["fits"] for row in found["layouts"])


def test_the_text_is_the_commands_json(server):
    """Byte for byte: the body is json.dumps(answer, indent=2), as the command prints it."""
    question = {**FORMULA_QUESTIONS[0], "method": "formula"}
    _, body, text = ask(server, question)
    assert text == json.dumps(body, indent=2)


def test_a_link_asks_the_same_question(server):
    question = {**FORMULA_QUESTIONS[0], "method": "formula"}
    query = "&".join(f"{k}={v}".replace(" ", "%20") for k, v in question.items())
    status, body, _ = request(f"{server}/api/estimate?{query}")
    assert status == 200
    assert body == answer_of(server, question)


DEEPSPEED_QUESTION = {"config": TINY_CONFIG, "batch": 2, "seq": 128, "client": "trainer", "num_gpus": 2,
                      "weights_dtype": "bf16", "method": "exact"}
GRPO_QUESTION = {"config": TINY_CONFIG, "batch": 8, "seq": 16, "client": "grpo", "num_generations": 4,
                 "max_completion_length": 8, "weights_dtype": "bf16", "method": "exact"}
NESTED_500 = {"stage": 2}
for _ in range(500):
    NESTED_500 = {"zero_optimization": NESTED_500}
GUIDE_ZERO2_OFFLOAD = json.loads((REPO / "config" / "deepspeed" / "guide" / "zero2_offload.json").read_text())

BAD = [
    ({"model": SMALL, "batch": 0, "seq": 128, "precision": "bf16", "method": "formula"}, "batch"),
    ({"model": SMALL, "batch": 1, "seq": 128, "precision": "bf16", "method": "formula", "colour": 1}, "unknown field"),
    ({"config": "/etc/passwd", "batch": 1, "seq": 128, "precision": "bf16", "method": "exact"}, "reads no paths"),
    ({"model": SMALL, "batch": 1, "seq": 128, "precision": "bf16", "method": "exact",
      "training_args": "training_args.json"}, "reads no paths"),
    ({"model": SMALL, "batch": 1, "seq": 128, "precision": "bf16", "coefficients": "x.json"}, "coefficient file"),
    ({"config": {"model_type": "no_such_architecture", "hidden_size": 64}, "batch": 1, "seq": 128,
      "precision": "bf16", "method": "exact"}, "model_type"),
    ({"config": {"hidden_size": 64}, "batch": 1, "seq": 128, "precision": "bf16", "method": "formula"}, "model_type"),
    ({"model": SMALL, "batch": 1, "seq": 128, "precision": "bf17", "method": "exact"}, "precision"),
    ({"model": SMALL, "batch": 1, "seq": 128, "precision": "bf16", "method": "formula", "gpu": "RTX 9090"}, "GPU"),
    ({"model": SMALL, "batch": 1, "seq": 128, "precision": "bf16", "method": "magic"}, "method"),
    ({"model": SMALL, "batch": 1, "precision": "bf16", "method": "formula"}, "seq"),
    ({"model": SMALL, "seq": 128, "precision": "bf16", "method": "formula", "gpu": "T4", "max_batch_size": True,
      "max_seq_len": True}, "not both"),
    ({"model": SMALL, "seq": 128, "precision": "bf16", "method": "formula", "max_batch_size": True}, "GPU"),
    ({"model": SMALL, "batch": 4096, "seq": 8192, "precision": "bf16", "method": "exact"}, "limit"),
    ({"model": SMALL, "batch": 1, "seq": 128, "precision": "bf16", "method": "exact",
      "attn_implementation": "kernels-community/flash-attn"}, "attn_implementation"),
    ({"model": SMALL, "batch": 1, "seq": 128, "precision": "bf16", "method": "exact", "num_gpus": 4}, "sharding"),
    ({"model": "nobody/not-a-model", "batch": 1, "seq": 128, "precision": "bf16", "method": "exact"}, "registry"),
    ({"model": SMALL, "batch": 1, "seq": 128, "precision": "bf16", "method": "formula",
      "gpu_memory_gib": 1e9}, "limit"),
    ({"model": SMALL, "batch": 1, "seq": 128, "precision": "bf16", "method": "formula",
      "sft_config": "/etc/passwd"}, "reads no paths"),
    ({"model": SMALL, "batch": 1, "seq": 128, "precision": "bf16", "client": "sft", "method": "formula",
      "liger_kernel": "yes"}, "liger_kernel must be true or false"),
    ([1, 2, 3], "JSON object"),
    # several GPUs and the layouts
    ({**LLAMA_13B, "gpu": None, "layouts": True}, "layouts needs the GPU"),
    ({**LLAMA_13B, "gpu": None, "min_gpus": True, "method": "exact"}, "min_gpus needs the GPU"),
    ({**LLAMA_13B, "layouts": True, "min_gpus": True}, "not both layouts and min_gpus"),
    ({**LLAMA_13B, "layouts": True, "max_batch_size": True}, "not both max_batch_size and layouts"),
    ({**LLAMA_13B, "layouts": "yes"}, "layouts must be true or false"),
    ({**LLAMA_13B, "num_gpus": 16, "sharding": "hsdp", "shard_group": 0}, "shard_group must be a positive integer"),
    ({**LLAMA_13B, "num_gpus": 16, "sharding": "fsdp", "tensor_parallel": "2"}, "tensor_parallel must be a positive"),
    ({**LLAMA_13B, "num_gpus": 16, "sharding": "fsdp", "tensor_parallel": 2048}, "tensor_parallel 2048 is over the"),
    ({**LLAMA_13B, "num_gpus": 16, "sharding": "hsdp"}, "needs a shard_group"),
    ({**LLAMA_13B, "num_gpus": 16, "sharding": "hsdp", "shard_group": 3}, "shard_group 3 does not divide"),
    ({**LLAMA_13B, "num_gpus": 6, "sharding": "fsdp", "tensor_parallel": 4}, "tensor_parallel 4 does not divide"),
    ({**LLAMA_13B, "accelerate_config": "/etc/passwd"}, "accelerate_config must be a JSON object"),
    ({**LLAMA_13B, "accelerate_config": {**ACCELERATE_FSDP, "num_processes": 5000}}, "num_processes 5000 is over"),
    ({**LLAMA_13B, "accelerate_config": {**ACCELERATE_FSDP, "fsdp_colour": 1}}, "unknown accelerate config key"),
    # DeepSpeed configs: a size beyond any GPU (refused before simulating), an object nested 500 deep, and the
    # DeepSpeed guide's config with the Trainer's default warmup of 0 steps (DeepSpeed's WarmupLR refuses it)
    ({**DEEPSPEED_QUESTION, "deepspeed": {"zero_optimization": {"stage": 2, "reduce_bucket_size": 1e30}}},
     "more than 1e+13 elements"),
    ({**DEEPSPEED_QUESTION, "deepspeed": NESTED_500}, "nested more than 32 levels"),
    ({**DEEPSPEED_QUESTION, "deepspeed": GUIDE_ZERO2_OFFLOAD}, "the run would stop before its first step"),
    # GRPO: a generation batch TRL refuses, the server's caps, a colocated vLLM too small for its weights
    ({**GRPO_QUESTION, "batch": 6}, "multiple of num_generations 4"),
    ({**GRPO_QUESTION, "num_generations": 128}, "num_generations 128 is over the server's limit"),
    ({**GRPO_QUESTION, "max_completion_length": "long"}, "max_completion_length must be a positive integer"),
    ({**GRPO_QUESTION, "grpo_config": "grpo.yaml"}, "reads no paths"),
    # a framework file's YAML text: too deep, too long, an optimizer that is not a name
    ({"axolotl_config": "base_model: x\nlr: " + "[" * 5000 + "]" * 5000, "method": "exact"},
     "nested more than 32 levels deep"),
    ({"axolotl_config": "base_model: x\n" + "# padding\n" * 8000, "method": "exact"}, "over 64 KiB of YAML"),
    ({"axolotl_config": "base_model: HuggingFaceTB/SmolLM2-135M\nmicro_batch_size: 1\noptimizer: [adamw]\n",
      "method": "formula", "gpu": "L4"}, "the optimizer must be a name"),
    # the same caps on a training file's own numbers
    ({**GRPO_QUESTION, "grpo_config": {"num_generations": 4096}}, "grpo_config's num_generations 4096 is over"),
    ({"axolotl_config": {"base_model": SMALL, "micro_batch_size": 2, "sequence_len": 512,
                         "gradient_accumulation_steps": 100000}, "method": "exact"},
     "axolotl_config's gradient_accumulation_steps 100000 is over"),
    ({"axolotl_config": {"base_model": SMALL, "micro_batch_size": 2, "sequence_len": 512, "rl": "grpo",
                         "trl": {"max_completion_length": 10**7}}, "method": "exact"}, "max_completion_length 1e+07"),
    ({"axolotl_config": "axolotl.yaml", "method": "exact"}, "reads no paths"),
    ({"llamafactory_config": {"stage": "kto", "do_train": True, "cutoff_len": 512, "per_device_train_batch_size": 1},
      "model": SMALL, "method": "exact"}, "stage 'kto' is not simulated"),
    ({**GRPO_QUESTION, "model": "Qwen/Qwen2.5-7B", "config": None, "use_vllm": True,
      "vllm_gpu_memory_utilization": 0.1, "gpu": "H100 80GB"}, "vLLM (colocate) would not start"),
]


@pytest.mark.parametrize("body,words", BAD, ids=[w for _, w in BAD])
def test_bad_input_is_a_400_with_one_line(server, body, words):
    status, answer, text = ask(server, body)
    assert status == 400, answer
    assert set(answer) == {"error"} and words.lower() in answer["error"].lower()
    assert "\n" not in answer["error"] and "Traceback" not in text


def raw_post(url: str, head: str, body: bytes) -> tuple[int, dict]:
    """(status, JSON body) of a POST written by hand; the server may answer before the body is sent."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        try:
            sock.sendall(f"POST /api/estimate HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n{head}\r\n".encode())
            sock.sendall(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # it answered already
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    status_line, _, rest = reply.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2])


def test_a_body_that_is_not_json_or_too_large(server):
    status, answer, _ = request(f"{server}/api/estimate", b"{not json")
    assert status == 400 and "not JSON" in answer["error"]
    too_large = b" " * ((1 << 20) + 1)
    # refused on its declared length, and (chunked, no length declared) once it is read past the limit
    status, answer = raw_post(server, f"Content-Type: application/json\r\nContent-Length: {len(too_large)}\r\n", b"")
    assert status == 413 and "limit" in answer["error"]
    chunked = b"".join(f"{len(part):x}\r\n".encode() + part + b"\r\n"
                       for part in (too_large[i:i + 65536] for i in range(0, len(too_large), 65536))) + b"0\r\n\r\n"
    status, answer = raw_post(server, "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n", chunked)
    assert status == 413 and "limit" in answer["error"]


def test_models_are_the_registry(server):
    from pipeline.core.paths import DEFAULT_REGISTRY
    from pipeline.inputs.registry import load_registry

    status, models, _ = request(f"{server}/api/models")
    assert status == 200
    assert [m["id"] for m in models] == [e.id for e in load_registry(DEFAULT_REGISTRY, check_model_types=False)]
    small = next(m for m in models if m["id"] == SMALL)
    assert small["family"] and small["model_type"] == "llama" and small["parameters"] == 134515008
    assert small["formula"] is True and small["context_length"] > 0


def test_gpus_are_the_catalogue(server):
    from pipeline.formulas.gpus import DEVICES

    status, gpus, _ = request(f"{server}/api/gpus")
    assert status == 200
    assert [g["name"] for g in gpus] == list(DEVICES)
    assert all(g["total_bytes"] == DEVICES[g["name"]].total_bytes for g in gpus)


def test_accuracy_and_info(server):
    status, accuracy, _ = request(f"{server}/api/accuracy")
    assert status == 200 and {"formula", "exact"} <= set(accuracy)
    assert 0 <= accuracy["exact"]["median"] < accuracy["exact"]["worst"] < 1
    status, info, _ = request(f"{server}/api/info")
    assert status == 200 and "bf16" in info["precisions"] and "refuses" in info["limits"]
    assert info["precision_modes"]["bf16-autocast"] == {"weights": "bf16", "autocast": "bf16"}
    assert info["precision_modes"]["amp-bf16"] == {"weights": "fp32", "autocast": "bf16"}


def test_an_sft_users_words_ask_bf16_autocast(server):
    """bf16 weights under SFTTrainer's default bf16=True: the answer is bf16-autocast's, as the command's."""
    question = {**FORMULA_QUESTIONS[-1], "method": "formula"}
    answer = answer_of(server, question)
    assert answer["precision"] == "bf16-autocast" and answer["client"] == "sft"
    assert answer == cli_json(question)
    assert answer != answer_of(server, {**{k: v for k, v in question.items() if k != "weights_dtype"},
                                        "precision": "bf16"})


def test_a_grpo_question_is_the_commands(server):
    """GRPO asked of the server: the same answer as the command's, with the phase of the peak and the rollout."""
    answer = answer_of(server, GRPO_QUESTION)
    assert answer == cli_json(GRPO_QUESTION)
    assert answer["client"] == "grpo" and answer["peak_phase"] in answer["phase_peaks"]
    assert answer["rollout"]["num_generations"] == 4 and answer["rollout"]["max_completion_length"] == 8


def test_the_accuracy_of_a_setting(server):
    """GET /api/setting-accuracy answers the catalogue's lookup for the answer's words; bad words are a 400."""
    from pipeline.serve.catalogue import setting_accuracy

    status, found, _ = request(f"{server}/api/setting-accuracy?client=sft&precision=bf16-autocast&lora_r=16"
                               "&quantization=nf4&liger_kernel=false&num_gpus=1")
    assert status == 200
    assert found == json.loads(json.dumps(setting_accuracy(
        {"client": "sft", "precision": "bf16-autocast", "lora_r": 16, "quantization": "nf4"})))
    assert found["methods"]["exact"]["split"] == "held-out" and found["methods"]["exact"]["points"] == 4
    status, found, _ = request(f"{server}/api/setting-accuracy?client=trainer&precision=fp32&num_gpus=8&sharding=hsdp"
                               "&tensor_parallel=2")
    assert status == 200 and found["methods"] == {}
    assert found["missing"] == ("no point of this setting (Trainer, full fine-tuning, fp32, 8 GPUs, hsdp+tp) is "
                                "measured on a GPU: its accuracy is unknown")
    for query, named in (("client=banana&precision=bf16", "client"), ("precision=bf16&lora_r=x", "lora_r"),
                         ("precision=bf16&seq=4", "seq"), ("precision=bf16&num_gpus=8", "sharding"),
                         ("precision=bf16&num_gpus=8&sharding=fsdp&tensor_parallel=two", "tensor_parallel")):
        status, body, _ = request(f"{server}/api/setting-accuracy?{query}")
        assert status == 400 and list(body) == ["error"] and named in body["error"]


def test_concurrent_questions_are_not_mixed(server):
    """Formula questions (threads of the server) and exact ones (its simulator) at once: each gets its own answer."""
    questions = [{**q, "method": "formula"} for q in FORMULA_QUESTIONS[:4]]
    questions += [{**FORMULA_QUESTIONS[0], "batch": b, "method": "formula"} for b in (1, 2, 3)]
    questions += [{**EXACT_QUESTIONS[1], "batch": b, "method": "exact"} for b in (1, 3)]
    alone = [answer_of(server, q) for q in questions]
    together = [None] * len(questions)

    def one(i):
        together[i] = answer_of(server, questions[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(questions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert together == alone
    assert len({json.dumps(a, sort_keys=True) for a in alone}) == len(questions)


def test_the_page_loads_nothing_from_elsewhere(server):
    import urllib.request

    with urllib.request.urlopen(f"{server}/") as response:
        html = response.read().decode()
        assert "default-src 'self'" in response.headers["Content-Security-Policy"]
    assert '<script src="/static/app.js"' in html and 'href="/static/style.css"' in html
    texts = [html] + [urllib.request.urlopen(f"{server}/static/{name}").read().decode() for name in ("app.js", "style.css")]
    external = [u for text in texts for u in re.findall(r"(?:https?:)?//[A-Za-z0-9.-]+\.[a-z]{2,}[^\s\"'`)]*", text)
                if not u.startswith("http://www.w3.org/2000/svg")]
    assert external == []


def test_the_server_binds_localhost_by_default():
    from pipeline.cli import build_parser

    args = build_parser().parse_args(["serve"])
    assert (args.host, args.port) == ("127.0.0.1", 7860)


def test_the_formula_needs_no_torch():
    """The server answers formula questions in its own process: no torch, no transformers imported."""
    code = ("import json, sys; from pipeline.serve.questions import answer, check, needs_torch; "
            f"q = check({{'model': {SMALL!r}, 'batch': 2, 'seq': 64, 'precision': 'bf16', 'method': 'formula', "
            "'gpu': 'T4', 'lora_r': 8, 'max_batch_size': True}); assert not needs_torch(q); answer(q); "
            "print(json.dumps(sorted(m for m in ('torch', 'transformers') if m in sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=offline_env(), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []


@pytest.mark.slow
def test_a_simulation_past_the_limit_is_stopped_and_the_next_one_runs():
    from pipeline.core.errors import UserError
    from pipeline.serve.worker import SimulationTimeout, Simulator

    question = {"model": SMALL, "batch": 1, "seq": 64, "precision": "bf16", "method": "exact"}
    simulator = Simulator(timeout_s=0.5, warm=False)
    try:
        with pytest.raises(SimulationTimeout):
            simulator.ask(question)  # the cold worker imports torch first: well past 0.5 s
        simulator.timeout_s = 300
        assert simulator.ask(question)["method"] == "exact"
        with pytest.raises(UserError, match="precision"):
            simulator.ask({**question, "precision": "fp8"})
    finally:
        simulator.close()


def live_processes_of_group(group: int) -> list[int]:
    """The processes of a process group that still run (zombies left to init are dead: they hold no memory)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


@pytest.mark.slow
def test_a_streamed_search_past_the_limit_says_so_after_the_rows_it_has():
    """Streamed, the exact table stopped at the server's time limit ends with a "stopped" event after the rows
    simulated before it (they stand), and the next question runs."""
    from pipeline.serve.worker import Simulator

    simulator = Simulator(timeout_s=300, warm=False)
    try:
        small = {"config": TINY_CONFIG, "batch": 1, "seq": 64, "precision": "bf16", "method": "exact", "gpu": "T4"}
        simulator.ask(small)
        simulator.timeout_s = 25
        events = list(simulator.ask_stream({**small, "layouts": True, "num_gpus": 1024,
                                            "config": {**TINY_CONFIG, "num_hidden_layers": 24}}))
        assert events[0]["event"] == "start" and events[-1]["event"] == "stopped"
        assert "time limit of 25 s stopped the search" in events[-1]["reason"]
        rows = [e for e in events if e["event"] == "row"]
        assert 0 < len(rows) < events[0]["layouts"]
        simulator.timeout_s = 300
        assert simulator.ask(small)["method"] == "exact"
    finally:
        simulator.close()


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the processes of /proc")
def test_a_layouts_table_past_the_limit_stops_the_processes_it_started():
    """The exact layouts table simulates its layouts in processes the worker starts: stopped past the time limit,
    the worker takes them with it (its process group), and the next question runs."""
    from pipeline.serve.worker import SimulationTimeout, Simulator

    small = {"config": TINY_CONFIG, "batch": 1, "seq": 64, "precision": "bf16", "method": "exact", "gpu": "T4"}
    simulator = Simulator(timeout_s=300, warm=False)
    try:
        simulator.ask(small)
        worker = simulator._process.pid
        simulator.timeout_s = 20
        seen = []
        watching = threading.Event()

        def watch():
            while not watching.is_set():
                seen.append(len(live_processes_of_group(worker)))
                time.sleep(0.2)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            with pytest.raises(SimulationTimeout):
                simulator.ask({"model": "Qwen/Qwen2.5-0.5B", "batch": 2, "seq": 512, "precision": "bf16",
                               "method": "exact", "gpu": "T4", "layouts": True, "num_gpus": 64})
        finally:
            watching.set()
            watcher.join()
        assert max(seen) >= 3  # the worker and its simulations' processes
        assert live_processes_of_group(worker) == []
        simulator.timeout_s = 300
        assert simulator.ask(small)["method"] == "exact"
    finally:
        simulator.close()
