"""Seconds per `pipeline.simulate.predict_peak` call on this machine (the brief: <= 2 s for a 7B model).

    python benchmarks/simulate_speed.py [--registry models.yaml] [--models ID ...]

Configs come from the registry's embedded facts (no network). "first" is a fresh process's first
call for the model (it builds the meta model); "again" is a later call at another (B, L), which
reuses the built model. Prints one table row per model and precision.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

DEFAULT_MODELS = ["HuggingFaceTB/SmolLM2-135M", "Qwen/Qwen2.5-1.5B", "meta-llama/Llama-2-7b-hf",
                  "Qwen/Qwen2.5-7B", "mistralai/Mistral-7B-v0.1"]
POINTS = [(1, 512), (4, 1024), (8, 2048)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--registry", default="models.yaml")
    parser.add_argument("--models", nargs="+", default=DEFAULT_MODELS)
    parser.add_argument("--precisions", nargs="+", default=["bf16", "fp32", "amp-bf16"])
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

    import torch

    from pipeline.inputs.configs import resolve_config
    from pipeline.inputs.registry import load_registry
    from pipeline.simulate.predict import cached_meta_model, loop_peak
    from pipeline.training.values import Run

    entries = {e.id: e for e in load_registry(args.registry, check_model_types=False)}
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, threads {torch.get_num_threads()}")
    print(f"{'model':32} {'precision':9} {'first s':>8} {'again s':>8} {'ckpt s':>7} {'peak GiB (B=1,L=512)':>21}")
    for model_id in args.models:
        if model_id not in entries:
            print(f"{model_id:32} not in {args.registry}", file=sys.stderr)
            continue
        config = resolve_config(entries[model_id], "embedded").config
        for precision in args.precisions:
            cached_meta_model.cache_clear()
            start = time.perf_counter()
            first = loop_peak(config, Run(*POINTS[0], precision))
            first_seconds = time.perf_counter() - start
            again = [loop_peak(config, Run(b, l, precision)).details["seconds"] for b, l in POINTS[1:]]
            ckpt = loop_peak(config, Run(*POINTS[1], precision, checkpointing=True)).details["seconds"]
            print(f"{model_id:32} {precision:9} {first_seconds:8.2f} {statistics.median(again):8.2f} {ckpt:7.2f} "
                  f"{first.peak_bytes / 2**30:21.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
