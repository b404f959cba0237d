"""Seconds for the exact answers at the sizes issue 37 names, cold (a fresh process, as a user's first command)
beside `python -c "import torch"`, written to benchmarks/results/large_answers.md:

    python benchmarks/large_answers.py [--skip-fewest]

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-fewest", action="store_true")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "large_answers.md"))
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    lines = [f"# Large exact answers, cold ({time.strftime('%Y-%m-%d')}, commit {commit}, {os.cpu_count()} CPUs, "
             f"{platform.processor() or platform.machine()}, load {os.getloadavg()[0]:.2f} at start)", "",
             "| question | wall s | CPU s | ended |", "|---|---:|---:|---|"]
    for name, argv in CASES.items():
        if args.skip_fewest and "fewest" in name:
            continue
        wall, cpu, ended = timed(argv)
        lines.append(f"| {name} | {wall:.1f} | {cpu:.1f} | {ended} |")
        print(lines[-1], flush=True)
    lines += ["", f"load {os.getloadavg()[0]:.2f} at the end; `python benchmarks/large_answers.py` made this file."]
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
