"""What a client measures while it runs: peak allocated bytes per phase, and storage sizes."""

from __future__ import annotations

import contextlib


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors`."""
    seen, total = set(), 0
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def optimizer_state_bytes(optimizer, device: str) -> int:
    """Bytes of optimizer state tensors on the measured device (AdamW's `step` counters stay on the
    CPU unless the optimizer is fused); of this rank's shards under FSDP2."""
    import torch

    tensors = [getattr(value, "_local_tensor", value)  # a DTensor (FSDP2): this rank's shard
               for state in optimizer.state.values() for value in state.values()
               if torch.is_tensor(value) and value.device.type == device]
    return storage_bytes(tensors)


def reserved_by_stream() -> dict:
    """Bytes of the CUDA allocator's segments per stream (a stream's pool serves that stream only; FSDP2
    all-gathers and reduce-scatters on streams of its own)."""
    import torch

    found: dict[str, int] = {}
    for segment in torch.cuda.memory_snapshot():
        stream = str(segment.get("stream", 0))
        found[stream] = found.get(stream, 0) + int(segment["total_size"])
    return found


class PhaseTracker:
    """Peak allocated bytes per phase (forward, backward, optimizer), maximised over the steps.

        with tracker.phase("forward"):
            loss = ...

    or, where the phases are only seen as events (hooks, callbacks), `start(name)` ends the current
    phase and starts the next, `stop()` ends the last. The CUDA peak counter is reset when a phase
    starts and read when it ends, so the max over phases is the peak over the steps. A phase that
    raises is not recorded and stays `current` (the failure's place). On other devices nothing is
    tracked and all peaks are None.
    """

    def __init__(self, device: str):
        self.cuda = device == "cuda"
        self.peaks: dict[str, int] = {}
        self.reserved = None
        self.current = None
        self.extra: dict = {}  # columns a client learns while it runs (SFTTrainer's trainable parameters)

    def start(self, name: str) -> None:
        import torch

        from pipeline.training import memory_history

        if self.current is not None:
            self.stop()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            memory_history.mark(name)
        self.current = name

    def stop(self) -> None:
        import torch

        if self.cuda:
            self.peaks[self.current] = max(self.peaks.get(self.current, 0), torch.cuda.max_memory_allocated())
            self.reserved = max(self.reserved or 0, torch.cuda.max_memory_reserved())
        self.current = None

    def restart(self, name: str) -> None:
        """Start phase `name` afresh, forgetting what the current phase has seen so far (on several GPUs the
        peak counter is reset when training begins: the sharding and wrapping before it are not counted)."""
        self.current = None
        self.start(name)

    @contextlib.contextmanager
    def phase(self, name: str):
        self.start(name)
        yield
        self.stop()

    def columns(self) -> dict:
        """The row's peak columns; `phase_peaks` every phase's (JSON), lists of `extra` as JSON."""
        import json

        peak = max(self.peaks.values()) if self.peaks else None
        extra = {k: json.dumps(v) if isinstance(v, list) else v for k, v in self.extra.items()}
        return {"peak_allocated_bytes": peak, "peak_reserved_bytes": self.reserved,
                "forward_peak_bytes": self.peaks.get("forward"),
                "backward_peak_bytes": self.peaks.get("backward"),
                "optimizer_peak_bytes": self.peaks.get("optimizer"),
                "phase_peaks": json.dumps(self.peaks) if self.peaks else None, **extra}
