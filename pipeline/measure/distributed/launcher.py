"""The driver of a several-GPU plan: one `torchrun` per point, in slots of the machine's GPUs.

The GPUs are cut into slots of N (`CUDA_VISIBLE_DEVICES`: on 4 GPUs, two groups of 2 run side by side, each
torchrun `--standalone`, on a rendezvous port of its own); a group's points run in order, smallest first, and
an out-of-memory point settles the larger ones (`plan.settled_by`). Every rank's row is appended to `<out>.jsonl` as its
point ends (resumable: points already there are not run again) and the table is written at the end. A point
whose torchrun outlives its timeout is killed with its process group and recorded as an error. NVLink
multicast stays off (NCCL_NVLS_ENABLE=0 and the two variables beside it: it reserves memory outside
PyTorch's allocator, and on a shared host it can take the GPUs out of service).
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pipeline.core.paths import CONFIGS
from pipeline.measure.distributed.plan import Group, groups, plan_adapter, read_plan, settled_by

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def adapter_columns(adapter: str) -> dict:
    """The adapter columns of a plan's adapter (`plan.plan_adapter`)."""
    spec = plan_adapter(adapter)
    return spec.columns() if spec is not None else dict.fromkeys(plan_adapter("lora").columns())


def point_key(row: dict) -> tuple:
    adapter = "full" if not row.get("lora_r") else "qlora" if row.get("quantization") else \
        "lora-dropout" if row.get("lora_dropout") else "lora"
    group = row.get("shard_group")
    return (row["model_id"], row["client"], row["precision"], int(row["num_gpus"]), row["sharding"],
            None if group is None else int(group), int(row.get("tensor_parallel") or 1), adapter,
            bool(row["gradient_checkpointing"]), row.get("deepspeed") or None, row.get("hyperparameters") or None,
            row.get("alloc_conf") or None, row.get("rollout") or None, row.get("packing") or None,
            int(row["batch_size"]), int(row["seq_len"]))


def run_plan(plan_path, out_path, dry_run: bool = False, config_path: str | None = None,
             devices: int | None = None, deadline: float | None = None) -> list[dict]:
    """Every point of the plan not yet in `out_path`.jsonl; returns all rows there. `devices`: the GPUs to use
    (default all; without GPUs the ranks run on the CPU with gloo); `deadline`: seconds after which no point
    starts."""
    plan = read_plan(plan_path)
    gpus = devices or (None if dry_run else max(_gpu_count(), 2))
    rows_path = Path(out_path).with_suffix(".jsonl")
    rows = read_rows(rows_path)
    done = {point_key(r) for r in rows}
    work = [g for g in groups(plan, gpus)]
    if dry_run:
        for group in work:
            for batch, seq in group.points:
                print(" ".join(torchrun_command(group, batch, seq, plan, "OUT", config_path)))
        return rows
    Scheduler(work, done, plan, rows_path, config_path, gpus, deadline).run()
    rows = read_rows(rows_path)
    if rows:
        import pandas as pd

        from pipeline.core.io import write_parquet

        write_parquet(pd.DataFrame(rows), out_path)
    return rows


class Scheduler:
    """Groups' points on slots of GPUs: one point per slot at a time, one point per group at a time."""

    def __init__(self, work: list[Group], done: set, plan: dict, rows_path: Path, config_path, gpus: int,
                 deadline: float | None):
        self.pending = {group.key: list(group.points) for group in work}
        self.groups = {group.key: group for group in work}
        self.oom_at = {group.key: [] for group in work}
        self.device_of = {}  # group key -> the device columns of its out-of-memory point
        self.done, self.plan, self.rows_path, self.config_path = done, plan, rows_path, config_path
        self.gpus, self.started = gpus, time.monotonic()
        self.deadline = deadline
        self.running: dict[tuple, tuple] = {}  # group key -> (process, slot, point, folder, started)
        self.retries = collections.Counter()  # (group key, point) -> times queued again after a port race

    def run(self) -> None:
        self.rows_path.parent.mkdir(parents=True, exist_ok=True)
        while self.pending or self.running:
            self.reap()
            launched = self.launch_next()
            if not launched:
                if not self.running:
                    if not any(self.pending.values()):
                        break
                    if self.past_deadline():
                        print(f"measure-distributed: deadline reached, {sum(map(len, self.pending.values()))} "
                              "points left", file=sys.stderr)
                        break
                time.sleep(0.5)

    def past_deadline(self) -> bool:
        return self.deadline is not None and time.monotonic() - self.started > self.deadline

    def free_slot(self, size: int) -> list[int] | None:
        busy = {gpu for _, slot, *_ in self.running.values() for gpu in slot}
        for first in range(0, self.gpus - size + 1, size):
            slot = list(range(first, first + size))
            if not busy & set(slot):
                return slot
        return None

    def launch_next(self) -> bool:
        if self.past_deadline():
            return False
        for key, points in list(self.pending.items()):
            if key in self.running:
                continue
            group = self.groups[key]
            while points:
                batch, seq = points[0]
                settled = settled_by((batch, seq), self.oom_at[key])
                if (*key, batch, seq) in self.done:
                    points.pop(0)
                elif settled:
                    points.pop(0)
                    self.settle(group, batch, seq, settled)
                else:
                    break
            if not points:
                del self.pending[key]
                continue
            slot = self.free_slot(group.num_gpus)
            if slot is None:
                continue
            batch, seq = points.pop(0)
            self.start(group, slot, batch, seq)
            return True
        return False

    def start(self, group: Group, slot: list[int], batch: int, seq: int) -> None:
        folder = Path(tempfile.mkdtemp(prefix="avp-point-"))
        env = dict(os.environ, **MULTICAST_OFF, CUDA_VISIBLE_DEVICES=",".join(visible_devices(slot)),
                   OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "4"))
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)  # the group's allocator settings, not the launcher's
        if group.alloc_conf:
            env["PYTORCH_CUDA_ALLOC_CONF"] = group.alloc_conf
        if os.environ.get("DS_ACCELERATOR") == "cpu" and _gpu_count():
            # the simulation layer's choice (`pipeline.simulate`), made in this process when the command line
            # imported it: a rank on a GPU lets DeepSpeed find its accelerator
            env.pop("DS_ACCELERATOR")
        log = open(folder / "log", "w")  # noqa: SIM115 - closed when the point is reaped
        process = subprocess.Popen(torchrun_command(group, batch, seq, self.plan, folder, self.config_path),
                                   env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.running[group.key] = (process, slot, (batch, seq), folder, time.monotonic(), log)

    def reap(self) -> None:
        for key, (process, slot, point, folder, started, log) in list(self.running.items()):
            group = self.groups[key]
            timed_out = time.monotonic() - started > group.timeout
            if process.poll() is None and not timed_out:
                continue
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            log.close()
            del self.running[key]
            rows = [json.loads(p.read_text()) for p in sorted(folder.glob("rank*.json"))]
            log_text = (folder / "log").read_text(errors="replace")
            if not rows and not timed_out and self.retry_after_port_race(key, point, log_text):
                shutil.rmtree(folder, ignore_errors=True)
                continue
            if len(rows) < group.num_gpus:
                tail = log_text.strip().splitlines()[-3:]
                reason = ("timed out after " f"{group.timeout} s" if timed_out else f"torchrun exit {process.returncode}")
                rows = self.missing_ranks(group, point, rows, f"{reason}: {' | '.join(tail)[-400:]}")
            self.keep_history(folder, rows)
            shutil.rmtree(folder, ignore_errors=True)  # what it held is in the rows now
            if any(r["status"] == "oom" for r in rows):
                self.oom_at[key].append(point)
                self.device_of[key] = {k: rows[0].get(k) for k in ("device", "driver_version", "gpu_total_bytes")}
            self.append(rows)

    def keep_history(self, folder: Path, rows: list) -> None:
        """Rank 0's allocator history of the point (`memory_history: true`) to `<out>.history/`, named by the
        point's row (`history_name`), which names the file in its `memory_history` column."""
        recorded = folder / "history.npz"
        if not recorded.exists():
            return
        name = history_name(rows[0]) if rows else folder.name
        target = self.rows_path.with_suffix(".history") / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(recorded), target)
        for row in rows:
            row["memory_history"] = f"{target.parent.name}/{name}"

    def retry_after_port_race(self, key: tuple, point: tuple, log_text: str) -> bool:
        """Queue the point again (at most twice) when its torchrun lost the race for a free port to a group beside
        it (`--standalone` picks the port, then binds it): nothing of the point ran."""
        if not port_race(log_text) or self.retries[(key, point)] >= 2:
            return False
        self.retries[(key, point)] += 1
        self.pending.setdefault(key, []).insert(0, point)
        return True

    def missing_ranks(self, group: Group, point: tuple, rows: list, reason: str) -> list:
        """Rows for the ranks that wrote none (killed by the launcher, or by torchrun after a rank failed):
        oom when another rank ran out of memory, else an error."""
        oom = any(r["status"] == "oom" for r in rows)
        seen = {int(r["rank"]) for r in rows}
        template = rows[0] if rows else None
        for rank in range(group.num_gpus):
            if rank in seen:
                continue
            row = dict(template) if template else self.empty_row(group, point)
            row.update(rank=rank, status="oom" if oom else "error",
                       reason=("another rank ran out of memory; " if oom else "") + reason,
                       peak_allocated_bytes=None, peak_reserved_bytes=None, nvml_used_bytes=None)
            rows.append(row)
        return rows

    def settle(self, group: Group, batch: int, seq: int, oom_at: tuple) -> None:
        rows = []
        for rank in range(group.num_gpus):
            row = self.empty_row(group, (batch, seq))
            row.update(self.device_of.get(group.key, {}))  # the GPU of the point that ran out of memory
            row.update(rank=rank, status="oom", reason=f"out of memory at B={oom_at[0]} L={oom_at[1]}")
            rows.append(row)
        self.append(rows)

    def empty_row(self, group: Group, point: tuple) -> dict:
        """A row for a point that ran nothing: its key and provenance, no measurement."""
        from pipeline.core.provenance import provenance

        # the launcher's software, not a device: the point never ran on one
        return {**provenance(), "device": None, "driver_version": None, "model_id": group.model_id,
                "client": group.client, "precision": group.precision,
                "num_gpus": group.num_gpus, "sharding": group.sharding, "shard_group": group.shard_group,
                "tensor_parallel": group.tensor_parallel, "gradient_checkpointing": group.checkpointing,
                "deepspeed": group.deepspeed, "hyperparameters": group.hyperparameters, "alloc_conf": group.alloc_conf,
                "rollout": group.rollout, "packing": group.packing,
                **adapter_columns(group.adapter), "batch_size": point[0],
                "seq_len": point[1], "split": group.split, "variant": "standard", "attn_implementation": "default"}

    def append(self, rows: list) -> None:
        with open(self.rows_path, "a") as handle:
            for row in sorted(rows, key=lambda r: int(r["rank"])):
                handle.write(json.dumps(row, default=str) + "\n")
                self.done.add(point_key(row))


def visible_devices(slot: list[int]) -> list[str]:
    """The CUDA devices of a slot: its indices among this process's visible devices (CUDA_VISIBLE_DEVICES, where
    set: two launchers on one machine each take a half of it)."""
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return [visible[i] if i < len(visible) else str(i) for i in slot] if visible else [str(i) for i in slot]


def history_name(row: dict) -> str:
    """A point's allocator history file: its model, client, layout and (B, L), and a digest of the rest of its key."""
    import hashlib

    digest = hashlib.sha1(json.dumps(point_key(row), default=str).encode()).hexdigest()[:8]
    parts = (row["model_id"].split("/")[-1], row["client"], row.get("sharding") or "tp", row["num_gpus"],
             f"B{row['batch_size']}", f"L{row['seq_len']}", digest)
    return "-".join(map(str, parts)) + ".npz"


def port_race(log_text: str) -> bool:
    """Whether torchrun's store failed to bind the port it had picked (another process took it meanwhile)."""
    return "EADDRINUSE" in log_text and "TCPStore" in log_text


def torchrun_command(group: Group, batch: int, seq: int, plan: dict, folder, config_path) -> list[str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={group.num_gpus}",
               "-m", "pipeline.measure.distributed", "rank",
               *group.rank_arguments(batch, seq), "--configs", str(plan.get("configs", CONFIGS)), "--out", str(folder)]
    if group.memory_history:
        command += ["--memory-history", str(Path(folder) / "history.npz")]
    return command + (["--config", config_path] if config_path else [])


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()
