"""Seconds for the exact answers at the sizes issue 37 names, cold (a fresh process, as a user's first command)
beside `python -c "import torch"`, and warm (`python -m pipeline serve` on localhost, each question asked twice,
the second timed: the server's worker keeps its imports and its layouts' simulation processes), written to
benchmarks/results/large_answers.md:

    python benchmarks/large_answers.py [--skip-fewest] [--skip-warm]

- Llama-3.1-70B, SFTTrainer with LoRA r=16, 8 GPUs under FSDP2 (B=1, L=2,048);
- Llama-3.1-8B, SFTTrainer, ZeRO-3 on 4 GPUs (B=2, L=2,048);
- the fewest H100s for the 70B question (`--min-gpus`, exact: every layout of N = 1, 2, 4, 8, ... simulated until
  one fits), capped at 600 s.

Each row gives wall and CPU seconds of the process and its children (the layouts' simulations run in processes of
their own); the machine's CPUs and load are printed with them. Configs are the registry's embedded facts
(HF_HUB_OFFLINE=1). Targets (issue 37): any single exact answer within 2x `import torch` cold and 5 s warm; the exact
fewest GPUs of a 70B model within 30 s warm.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
ESTIMATE = [sys.executable, "-m", "pipeline", "estimate", "--method", "exact", "--gpu", "H100 80GB", "--json"]
CASES = {
    "python -c 'import torch' (yardstick)": [sys.executable, "-c", "import torch"],
    "70B SFT + LoRA, 8 GPUs, fsdp": [*ESTIMATE, "--model", "meta-llama/Llama-3.1-70B", "--client", "sft",
                                     "--lora-r", "16", "--num-gpus", "8", "--sharding", "fsdp", "--batch", "1",
                                     "--seq", "2048"],
    "8B SFT, 4 GPUs, zero3": [*ESTIMATE, "--model", "meta-llama/Llama-3.1-8B", "--client", "sft", "--num-gpus", "4",
                              "--sharding", "zero3", "--batch", "2", "--seq", "2048"],
    "70B SFT + LoRA, fewest GPUs (exact)": [*ESTIMATE, "--model", "meta-llama/Llama-3.1-70B", "--client", "sft",
                                            "--lora-r", "16", "--batch", "1", "--seq", "2048", "--min-gpus"],
}
LIMIT_S = 600
# The same questions for the server (`/api/layouts` streams the fewest-GPUs search)
ASKED = {"model": "meta-llama/Llama-3.1-70B", "client": "sft", "lora_r": 16, "batch": 1, "seq": 2048,
         "gpu": "H100 80GB", "method": "exact"}
WARM = {"70B SFT + LoRA, 8 GPUs, fsdp": ("/api/estimate", {**ASKED, "num_gpus": 8, "sharding": "fsdp"}),
        "8B SFT, 4 GPUs, zero3": ("/api/estimate", {**ASKED, "model": "meta-llama/Llama-3.1-8B", "lora_r": None,
                                                    "batch": 2, "num_gpus": 4, "sharding": "zero3"}),
        "70B SFT + LoRA, fewest GPUs (exact)": ("/api/layouts", {**ASKED, "min_gpus": True})}


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(argv: list[str]) -> tuple[float, float, str]:
    """(wall, CPU seconds, how it ended) of one fresh process."""
    cpu, started = children_cpu(), time.perf_counter()
    try:
        done = subprocess.run(argv, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              timeout=LIMIT_S)
        ended = "ok" if done.returncode == 0 else f"exit {done.returncode}"
    except subprocess.TimeoutExpired:
        ended = f"stopped at {LIMIT_S} s"
    return time.perf_counter() - started, children_cpu() - cpu, ended


def warm_rows(skip_fewest: bool) -> list[str]:
    """Each question asked twice of a fresh server; the second's wall seconds (and the first's)."""
    import json
    import urllib.request

    sys.path.insert(0, str(REPO / "tests"))
    from serve_support import running_server

    lines = []
    with running_server(Path("/tmp/large_answers_server/server.log"), 600) as url:
        time.sleep(20)  # the worker's own warm-up question
        for name, (path, question) in WARM.items():
            if skip_fewest and "fewest" in name:
                continue
            body = json.dumps({k: v for k, v in question.items() if v is not None}).encode()
            seconds = []
            for _ in range(2):
                started = time.perf_counter()
                request = urllib.request.Request(f"{url}{path}", data=body, headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=LIMIT_S) as response:
                    response.read()
                seconds.append(time.perf_counter() - started)
            lines.append(f"| {name} | {seconds[1]:.1f} | (first ask {seconds[0]:.1f}) | warm |")
            print(lines[-1], flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-fewest", action="store_true")
    parser.add_argument("--skip-warm", action="store_true")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "large_answers.md"))
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    lines = [f"# Large exact answers, cold and warm ({time.strftime('%Y-%m-%d')}, commit {commit}, {os.cpu_count()} CPUs, "
             f"{platform.processor() or platform.machine()}, load {os.getloadavg()[0]:.2f} at start)", "",
             "| question | wall s | CPU s | ended |", "|---|---:|---:|---|"]
    for name, argv in CASES.items():
        if args.skip_fewest and "fewest" in name:
            continue
        wall, cpu, ended = timed(argv)
        lines.append(f"| {name} | {wall:.1f} | {cpu:.1f} | {ended} |")
        print(lines[-1], flush=True)
    if not args.skip_warm:
        lines += ["", "Warm (the server, the second ask of each question):", "",
                  "| question | wall s | | |", "|---|---:|---|---|", *warm_rows(args.skip_fewest)]
    lines += ["", f"load {os.getloadavg()[0]:.2f} at the end; `python benchmarks/large_answers.py` made this file."]
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
