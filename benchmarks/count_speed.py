"""How fast the activations stage counts: every registry model, and meta device versus real weights.

    python benchmarks/count_speed.py [--registry models.yaml] [--points blog standard] [--workers 2]

1. The stage command (`python -m pipeline activations`, a fresh process, imports included) on every
   registry model (models.yaml when it exists, else tests/data/models_small.yaml), once per point
   set: wall and CPU seconds, and per-model seconds (median, 90th percentile, max, the slowest
   models). Wall seconds depend on what else the machine runs: the load average is recorded.
2. Qwen2.5-1.5B, the blog's hook count at (1, 1): built on the meta device versus built with real
   random weights on the CPU, each in its own process (seconds and peak RSS from getrusage).

Writes benchmarks/results/count_speed.json and prints a markdown table to paste in the README.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "count_speed.json"
SMALL_REGISTRY = ROOT / "tests" / "data" / "models_small.yaml"
QWEN = "Qwen/Qwen2.5-1.5B"


def default_registry() -> Path:
    return ROOT / "models.yaml" if (ROOT / "models.yaml").exists() else SMALL_REGISTRY


def run(argv: list[str]) -> tuple[float, float]:
    """Wall seconds and CPU seconds (user + system, worker processes included) of one command.

    CPU seconds do not depend on what else runs on the machine; wall seconds do."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pipeline", *argv], cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def time_stage(registry: Path, points: str, workers: int, directory: Path) -> dict:
    import pandas as pd

    configs = directory / "configs.json"
    load_before = round(os.getloadavg()[0], 2)
    if not configs.exists():
        run(["configs", "--registry", str(registry), "--out", str(configs), "--source", "embedded"])
    models_out, activations_out = directory / f"models-{points}.parquet", directory / f"activations-{points}.parquet"
    seconds, cpu_seconds = run(["activations", "--registry", str(registry), "--configs", str(configs), "--points", points,
                   "--workers", str(workers), "--models-out", str(models_out), "--activations-out",
                   str(activations_out)])
    models, activations = pd.read_parquet(models_out), pd.read_parquet(activations_out)
    per_model = models["seconds"]
    slowest = models.nlargest(5, "seconds")
    return {
        "points": points,
        "workers": workers,
        "models": len(models),
        "model_status": models["status"].value_counts().to_dict(),
        "rows": len(activations),
        "row_status": activations["status"].value_counts().to_dict(),
        "forward_paths": activations["forward"].value_counts().to_dict(),
        "seconds": round(seconds, 1),
        "cpu_seconds": round(cpu_seconds, 1),
        "load_average_1min_before": load_before,
        "per_model_seconds": {"median": round(per_model.median(), 2), "p90": round(per_model.quantile(0.9), 2),
                              "max": round(per_model.max(), 2), "sum": round(per_model.sum(), 1)},
        "slowest": [{"model_id": r.model_id, "seconds": r.seconds, "parameters": None if pd.isna(r.parameters)
                     else int(r.parameters)} for r in slowest.itertuples()],
    }


def child(mode: str) -> None:
    """One Qwen2.5-1.5B hook count, in this process: `meta` or `cpu` (real random weights)."""
    start = time.perf_counter()
    import torch

    from pipeline.activations.counts import ModelCounter, hook_elements
    from pipeline.inputs.configs import resolve_model
    from pipeline.inputs.modeling import build_model

    config = resolve_model(QWEN, mode="embedded", registry_path=SMALL_REGISTRY).config
    build_model(config, device="meta")  # imports the model's code, the same for both modes
    imported = time.perf_counter()
    if mode == "meta":
        counter = ModelCounter(config)
        counter.model("float32")
        built = time.perf_counter()
        elements = counter.hook(1, 1).elements
    else:
        torch.manual_seed(0)
        model = build_model(config, device="cpu")
        built = time.perf_counter()
        elements = hook_elements(model, torch.zeros((1, 1), dtype=torch.int64))
    done = time.perf_counter()
    print(json.dumps({
        "mode": mode, "elements_per_token": elements,
        "import_seconds": round(imported - start, 2), "build_seconds": round(built - imported, 2),  # imports excluded
        "count_seconds": round(done - built, 2), "seconds": round(done - imported, 2),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }))


def time_qwen(mode: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", mode], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def markdown(result: dict) -> str:
    lines = ["| stage run | models | wall s | CPU s | per model: median / p90 / max s | slowest |",
             "|---|---|---|---|---|---|"]
    for stage in result["stage"]:
        per = stage["per_model_seconds"]
        lines.append(f"| points={stage['points']}, {stage['workers']} workers | {stage['models']} | "
                     f"{stage['seconds']} | {stage['cpu_seconds']} | {per['median']} / {per['p90']} / {per['max']} | "
                     f"{stage['slowest'][0]['model_id']} |")
    lines += ["", "| Qwen2.5-1.5B hook count at (1, 1) | build s | count s | peak RSS |", "|---|---|---|---|"]
    for mode, label in (("meta", "meta device (no weights)"), ("cpu", "CPU, real random weights")):
        r = result["qwen2.5-1.5b"][mode]
        lines.append(f"| {label} | {r['build_seconds']} | {r['count_seconds']} | {r['peak_rss_bytes'] / 2**30:.2f} GiB |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--registry", type=Path, default=None)
    parser.add_argument("--points", nargs="+", default=["blog", "standard"])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--child", choices=["meta", "cpu"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return 0
    from pipeline.core.io import write_json
    from pipeline.core.provenance import provenance

    registry = args.registry or default_registry()
    result = {
        "registry": str(registry.relative_to(ROOT) if registry.is_relative_to(ROOT) else registry),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "stage": [],
        "qwen2.5-1.5b": {},
        "date": time.strftime("%Y-%m-%d"),
        "provenance": provenance(include_device=False),
    }
    for mode in ("meta", "cpu"):
        result["qwen2.5-1.5b"][mode] = time_qwen(mode)
    with tempfile.TemporaryDirectory() as directory:
        for points in args.points:
            result["stage"].append(time_stage(registry, points, args.workers, Path(directory)))
            write_json(result, OUT)  # what is measured so far
    result["machine"]["load_average_1min_at_end"] = round(os.getloadavg()[0], 2)
    write_json(result, OUT)
    print(markdown(result))
    print(f"\n-> {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
