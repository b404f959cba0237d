"""Where the GRPO peak sits against SFT for the same model (README, docs/grpo.md): the exact simulator's answers
for one model on one H100, SFTTrainer on sequences of prompt + completion tokens against GRPOTrainer generating
those completions (beta 0 and 0.04), by phase. Writes results/grpo/against_sft.json and .md.

    python benchmarks/grpo/against_sft.py [--model Qwen/Qwen2.5-0.5B] [--prompt 128] [--completion 256]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

GIB = 2**30
OUT = Path(__file__).resolve().parents[2] / "results" / "grpo"


def rows(model: str, prompt: int, completion: int, batch: int) -> list[dict]:
    from pipeline.core.provenance import software
    from pipeline.estimate import estimate

    common = dict(batch=batch, precision="bf16-autocast", checkpointing=True, method="exact", gpu="H100 80GB")
    cases = [("sft", dict(client="sft", seq=prompt + completion)),
             ("grpo, beta 0", dict(client="grpo", seq=prompt, num_generations=batch,
                                   max_completion_length=completion)),
             ("grpo, beta 0.04", dict(client="grpo", seq=prompt, num_generations=batch,
                                      max_completion_length=completion, beta=0.04))]
    found = []
    for label, options in cases:
        answer = estimate(model, **common, **options)
        found.append({"case": label, "model": model, "batch": batch, "prompt": prompt, "completion": completion,
                      "peak_bytes": answer["peak_bytes"], "peak_reserved_bytes": answer["peak_reserved_bytes"],
                      "peak_phase": answer["peak_phase"], "phase_peaks": answer.get("phase_peaks"),
                      "step_peaks": answer.get("step_peaks"), **software()})
    return found


def table(found: list[dict]) -> str:
    phases = ("generation", "log-probs", "forward", "backward", "optimizer")
    lines = ["| run | peak (GiB) | reserved (GiB) | peak in | " + " | ".join(phases) + " |",
             "|---|---:|---:|---|" + "---:|" * len(phases)]
    for row in found:
        by_phase = row["phase_peaks"] or {}
        cells = [f"{by_phase[p] / GIB:.2f}" if p in by_phase else "" for p in phases]
        lines.append(f"| {row['case']} | {row['peak_bytes'] / GIB:.2f} | {row['peak_reserved_bytes'] / GIB:.2f} | "
                     f"{row['peak_phase']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="Qwen/Qwen2.5-0.5B")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--completion", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    found = rows(args.model, args.prompt, args.completion, args.batch)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "against_sft.json").write_text(json.dumps(found, indent=2) + "\n")
    head = (f"{args.model}, bf16 weights under autocast, checkpointing, one H100: SFT on {args.batch} sequences of "
            f"{args.prompt} + {args.completion} tokens; GRPO on {args.batch} completions of {args.completion} tokens "
            f"({args.batch} per prompt of {args.prompt}); peaks per phase in GiB (exact simulator).\n\n")
    (OUT / "against_sft.md").write_text(head + table(found))
    print(head + table(found))


if __name__ == "__main__":
    main()
