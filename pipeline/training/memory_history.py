"""The CUDA caching allocator's own record of a process's requests (`torch.cuda.memory._record_memory_history`),
kept as a small file: every event in order (its action, address, size and stream), marks (the phases of the
measurement, each explicit `torch.cuda.empty_cache()`) at their place among the events, and the device's numbers.

The measurement writes it (a several-GPU plan's `memory_history: true`: rank 0 of each point records from its
start); the simulator's allocator replays it (`pipeline.simulate.memory.history`): the same requests, with the
device's capacity, must give the same segments, also where the allocator gave its cached segments back and
tried again at the edge of out-of-memory. No stack is recorded (`context=None`): the file holds sizes only.
"""

from __future__ import annotations

import json
from pathlib import Path

# the snapshot's actions (torch/cuda/memory.py, `_record_memory_history`), coded by their index here
ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "segment_map",
           "segment_unmap", "oom", "snapshot")
MAX_ENTRIES = 8_000_000

_marks: list | None = None  # [(name, index of the next event)] while recording


def start() -> None:
    """Record this process's allocator events from now on (CUDA only), and `empty_cache` calls as marks."""
    global _marks
    import torch

    if _marks is not None:
        return
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=MAX_ENTRIES)
    _marks = []
    empty_cache = torch.cuda.empty_cache

    def marked_empty_cache():
        mark("empty_cache")
        empty_cache()

    torch.cuda.empty_cache = marked_empty_cache
    torch.cuda.memory.empty_cache = marked_empty_cache


def recording() -> bool:
    return _marks is not None


def mark(name: str) -> None:
    """A named place among the events (the next event's index); nothing when not recording. Each mark copies the
    history so far (torch offers no count of it): its host memory shows in the point's resident-memory peak."""
    if _marks is not None:
        _marks.append((name, len(_events())))


def _events() -> list:
    import torch

    return torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]


def save(path, meta: dict) -> None:
    """The events so far, the marks and `meta` (the device's and the run's numbers) to `path` (.npz)."""
    import numpy as np
    import torch

    events = _events()
    codes = {name: index for index, name in enumerate(ACTIONS)}
    columns = {"action": np.array([codes.get(e["action"], 255) for e in events], dtype=np.uint8),
               "addr": np.array([e["addr"] for e in events], dtype=np.uint64),
               "size": np.array([e["size"] for e in events], dtype=np.int64),
               "stream": np.array([e["stream"] for e in events], dtype=np.uint64)}
    # a full ring buffer has dropped its first events: the marks' indices would not point at theirs
    meta = {**meta, "marks": _marks or [], "events": len(events), "wrapped": len(events) >= MAX_ENTRIES,
            "total_bytes": torch.cuda.mem_get_info()[1],
            "max_memory_reserved": torch.cuda.max_memory_reserved(), "memory_reserved": torch.cuda.memory_reserved()}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, meta=np.array(json.dumps(meta, default=str)), **columns)


def load(path) -> dict:
    """{"action": [names], "addr", "size", "stream": arrays, "meta": dict} of a saved history."""
    import numpy as np

    with np.load(path) as data:
        found = {key: data[key] for key in ("addr", "size", "stream")}
        found["action"] = [ACTIONS[code] if code < len(ACTIONS) else "unknown" for code in data["action"]]
        found["meta"] = json.loads(str(data["meta"]))
    return found
