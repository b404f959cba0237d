"""What the server's tests share: a real `python -m pipeline serve` on a free localhost port, requests
to it, and the `python -m pipeline estimate ... --json` answer of the same question."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from conftest import REPO, offline_env, pipeline

# The command line's flag of each field (pipeline/estimate/cli.py; the page's copy has the same list).
FLAGS = {"batch": "--batch", "seq": "--seq", "precision": "--precision", "weights_dtype": "--weights-dtype",
         "client": "--client",
         "optimizer": "--optimizer", "optim": "--optim", "gradient_accumulation": "--gradient-accumulation",
         "checkpointing": "--checkpointing", "lora_r": "--lora-r", "lora_alpha": "--lora-alpha",
         "lora_targets": "--lora-targets", "lora_dropout": "--lora-dropout", "quantization": "--quantization", "num_gpus": "--num-gpus",
         "sharding": "--sharding", "shard_group": "--shard-group", "tensor_parallel": "--tensor-parallel",
         "accelerate_config": "--accelerate-config", "gpu": "--gpu", "gpu_memory_gib": "--gpu-memory",
         "expandable_segments": "--expandable-segments", "method": "--method", "max_batch_size": "--max-batch-size",
         "max_seq_len": "--max-seq-len", "layouts": "--layouts", "min_gpus": "--min-gpus",
         "attn_implementation": "--attn-implementation", "liger_kernel": "--liger-kernel", "alloc_conf": "--alloc-conf",
         "num_generations": "--num-generations", "max_completion_length": "--max-completion-length", "beta": "--beta",
         "use_vllm": "--use-vllm", "vllm_mode": "--vllm-mode",
         "vllm_gpu_memory_utilization": "--vllm-gpu-memory-utilization"}
# The JSON objects a question holds and the command reads from files.
FILES = {"config": "--config", "accelerate_config": "--accelerate-config"}

# A small llama of the pasted-config tests: quick to simulate, and named (the answer's model_id).
TINY_CONFIG = {"_name_or_path": "tests/tiny-llama", "model_type": "llama", "vocab_size": 1024, "hidden_size": 128,
               "intermediate_size": 344, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "max_position_embeddings": 2048, "tie_word_embeddings": False}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(log_path: Path, timeout_s: float = 60):
    """A real server (uvicorn, the simulator's process warming up) on a free port; yields its URL."""
    port = free_port()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, "-m", "pipeline", "serve", "--port", str(port)], cwd=REPO,
                                   env=offline_env(), stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    urllib.request.urlopen(f"{url}/api/gpus", timeout=2).read()
                    break
                except (urllib.error.URLError, ConnectionError):
                    if process.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"the server did not start: {log_path.read_text()[-2000:]}") from None
                    time.sleep(0.2)
            yield url
        finally:
            process.terminate()
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def request(url: str, body: bytes | None = None, method: str | None = None, timeout: float = 300) -> tuple:
    """(HTTP status, parsed JSON body, raw text) of one request."""
    req = urllib.request.Request(url, data=body, method=method or ("POST" if body is not None else "GET"),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as response:
            text = response.read().decode()
            return response.status, json.loads(text), text
    except urllib.error.HTTPError as exc:
        text = exc.read().decode()
        return exc.code, json.loads(text), text


def ask(url: str, question: dict) -> tuple:
    return request(f"{url}/api/estimate", json.dumps(question).encode())


def stream(url: str, question: dict, timeout: float = 300) -> tuple:
    """(HTTP status, the events of /api/layouts as they came: one JSON object a line; or the error body)."""
    req = urllib.request.Request(f"{url}/api/layouts", data=json.dumps(question).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as response:
            return response.status, [json.loads(line) for line in response if line.strip()]
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read().decode())


def cli_args(question: dict, folder: Path | None = None) -> list[str]:
    """The `estimate` command's arguments for a question (a pasted config or accelerate config: written to
    `folder`)."""
    args = ["estimate"]
    for name, value in question.items():
        if name == "model":
            args += ["--model", value]
        elif name in FILES:
            path = folder / f"{name}.json"
            path.write_text(json.dumps(value))
            args += [FILES[name], str(path)]
        elif value is True:
            args.append(FLAGS[name])
        elif value is not False and value is not None:
            args += [FLAGS[name], str(value)]
    return [*args, "--json"]


def cli_json(question: dict) -> dict:
    """What `python -m pipeline estimate ... --json` prints for the question."""
    with tempfile.TemporaryDirectory() as folder:
        result = pipeline(*cli_args(question, Path(folder)), cwd=REPO)
    return json.loads(result.stdout)
