"""How much of the sweep's GPU wall time is spent inside measured training steps (goal: >= 60%).

Reads the sweep's parts folder (per-row times, and the parent's `_events.jsonl`: parent and child
start/end) and prints markdown tables: per sweep invocation, where the time went, and the
estimate settings (config/sweep.yaml `estimate:`) that the measured times suggest.

    python benchmarks/sweep_efficiency.py [--parts results/peak_memory_parts]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from pipeline.core.paths import PEAK_PARTS as DEFAULT_PARTS
from pipeline.measure.sweep.parts import EVENTS_FILE, read_rows

GOAL = 0.60


def load(parts: Path) -> tuple[list[dict], list[dict]]:
    rows = [row for path in sorted(parts.glob("*__*.jsonl")) for row in read_rows(path)]
    return rows, read_rows(parts / EVENTS_FILE)


def invocations(events: list[dict], rows: list[dict]) -> list[dict]:
    """One entry per sweep command: from its Python process's start (imports and planning count:
    the GPU is held) to its last event or row (a killed parent has no parent_end)."""
    runs = []
    for event in events:
        if event["event"] == "parent_start":
            runs.append({"start": event.get("process_started") or event["time"], "first": event["time"],
                         "gpus": event.get("gpus", 1), "children": 0})
        elif runs and event["event"] == "child_start":
            runs[-1]["children"] += 1
    for index, run in enumerate(runs):
        limit = runs[index + 1]["first"] if index + 1 < len(runs) else float("inf")
        times = [e["time"] for e in events if run["first"] <= e["time"] < limit]
        times += [r["finished_at"] for r in rows if r.get("finished_at") and run["first"] <= r["finished_at"] < limit]
        run["end"] = max(times)
    return runs


def measured(rows: list[dict]) -> list[dict]:
    """Rows of points that ran (ok, or oom/error while running); rows written without running
    (skipped, pruned, a failed child's remaining points) start and finish at the same instant."""
    return [r for r in rows if (r.get("finished_at") or 0) > (r.get("started_at") or 0)]


def child_spans(events: list[dict]) -> list[tuple[float, float, int]]:
    starts = {e["pid"]: e["time"] for e in events if e["event"] == "child_start"}
    return [(starts[e["pid"]], e["time"], e["pid"]) for e in events if e["event"] == "child_end" and e["pid"] in starts]


def efficiency_table(runs: list[dict], rows: list[dict]) -> list[str]:
    lines = ["| run | started (unix) | GPUs | wall s | device min | children | points run | in steps s | share |",
             "|---|---|---|---|---|---|---|---|---|"]
    total_wall = total_device = total_steps = 0.0
    total_points = 0
    for number, run in enumerate(runs, 1):
        inside = [r for r in measured(rows) if run["start"] <= (r.get("finished_at") or 0) <= run["end"] + 1]
        steps = sum(r.get("steps_seconds_total") or 0.0 for r in inside)
        wall = run["end"] - run["start"]
        device = wall * run["gpus"] / 60
        total_wall, total_device, total_steps = total_wall + wall, total_device + device, total_steps + steps
        total_points += len(inside)
        lines.append(f"| {number} | {run['start']:.0f} | {run['gpus']} | {wall:.1f} | {device:.2f} | {run['children']} "
                     f"| {len(inside)} | {steps:.1f} | {_share(steps, wall * run['gpus'])} |")
    gpu_seconds = total_device * 60
    lines.append(f"| all | | | {total_wall:.1f} | {total_device:.2f} | | {total_points} | {total_steps:.1f} "
                 f"| {_share(total_steps, gpu_seconds)} |")
    verdict = "meets" if gpu_seconds and total_steps / gpu_seconds >= GOAL else "misses"
    lines.append("")
    lines.append(f"Share of GPU wall time inside measured training steps: {_share(total_steps, gpu_seconds)} "
                 f"({verdict} the {GOAL:.0%} goal); device minutes: {total_device:.2f}.")
    return lines


def _share(part: float, whole: float) -> str:
    return f"{part / whole:.1%}" if whole > 0 else "n/a"


def breakdown_table(runs: list[dict], rows: list[dict], events: list[dict]) -> list[str]:
    """Wall time split: outside children (imports, planning, aggregation), child setup (fork, CUDA
    context, build), points outside their steps (allocation, empty_cache), the steps themselves."""
    wall = sum(run["end"] - run["start"] for run in runs)
    spans = child_spans(events)
    in_children = sum(end - start for start, end, _ in spans)
    runs_rows = measured(rows)
    first_point = {}
    for row in runs_rows:
        pid = row.get("child_pid")
        first_point[pid] = min(first_point.get(pid, float("inf")), row.get("started_at") or float("inf"))
    setup = sum(max(0.0, first_point[pid] - start) for start, end, pid in spans
                if pid in first_point and first_point[pid] <= end)
    in_points = sum((r["finished_at"] - r["started_at"]) for r in runs_rows if r.get("started_at"))
    steps = sum(r.get("steps_seconds_total") or 0.0 for r in runs_rows)
    parts = [("parent outside children", wall - in_children), ("child setup before its first point", setup),
             ("children between points (skipped rows, pruning, row writes)", in_children - setup - in_points),
             ("points outside the steps (allocation, empty_cache, NVML)", in_points - steps),
             ("inside measured steps", steps)]
    lines = ["| where | seconds | share of wall |", "|---|---|---|"]
    lines += [f"| {name} | {seconds:.1f} | {_share(seconds, wall)} |" for name, seconds in parts]
    return lines


def calibration_table(rows: list[dict], events: list[dict]) -> list[str]:
    """TimeModel settings suggested by the measured times (medians), to put in config/sweep.yaml."""
    ok = [r for r in rows if r.get("status") == "ok" and r.get("step_seconds")]
    lines = ["| estimate setting | suggested | from |", "|---|---|---|"]
    for precision in ("fp32", "bf16", "amp-bf16"):
        big = sorted((r for r in ok if r["precision"] == precision and r.get("step_flops")),
                     key=lambda r: r["step_flops"])[-20:]
        if big:
            rate = statistics.median(r["step_flops"] / r["step_seconds"] for r in big)
            lines.append(f"| flops_per_second.{precision} | {rate:.3g} | 6*N*B*L / step_seconds, "
                         f"{len(big)} largest points |")
    overhead = [r["finished_at"] - r["started_at"] - r["steps_seconds_total"]
                for r in ok if r.get("steps_seconds_total")]
    if overhead:
        lines.append(f"| point_overhead_seconds | {statistics.median(overhead):.3f} | point span minus its steps, "
                     f"{len(overhead)} points |")
    first = {}
    for row in ok:
        pid = row.get("child_pid")
        first[pid] = min(first.get(pid, float("inf")), row["started_at"])
    setups = [first[pid] - start for start, _, pid in child_spans(events) if pid in first]
    if setups:
        lines.append(f"| process_overhead_seconds + build | {statistics.median(setups):.2f} | child start to its first "
                     f"point, {len(setups)} children |")
    small = sorted(ok, key=lambda r: r.get("tokens") or 0)[:20]
    if small:
        median = statistics.median(r["step_seconds"] for r in small)
        lines.append(f"| step_floor_seconds + layers * layer_step_seconds | {median:.4f} "
                     f"| median step of the {len(small)} smallest points |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default=DEFAULT_PARTS)
    args = parser.parse_args(argv)
    rows, events = load(Path(args.parts))
    runs = invocations(events, rows)
    if not runs:
        print(f"no sweep runs recorded in {args.parts}")
        return 1
    statuses = {}
    for row in rows:
        statuses[row.get("status")] = statuses.get(row.get("status"), 0) + 1
    print(f"## Sweep efficiency ({args.parts}: {len(rows)} rows, "
          f"{', '.join(f'{k}: {v}' for k, v in sorted(statuses.items(), key=str))})\n")
    print("\n".join(efficiency_table(runs, rows)))
    print("\n### Where the wall time went\n")
    print("\n".join(breakdown_table(runs, rows, events)))
    print("\n### TimeModel settings suggested by these times\n")
    print("\n".join(calibration_table(rows, events)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
