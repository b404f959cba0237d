"""PYTORCH_CUDA_ALLOC_CONF as a run gives it ("expandable_segments:True,garbage_collection_threshold:0.6"): what the
allocator replay does with each of its keys (c10/cuda/CUDAAllocatorConfig).

- expandable_segments: replayed (`simulate.memory.allocator.ExpandableSegments`);
- garbage_collection_threshold: accepted and noted: the caching allocator collects its cached blocks only when
  the process has set a memory fraction (`torch.cuda.set_per_process_memory_fraction`: `malloc`'s
  `allowed_memory_maximum.has_value() && garbage_collection_threshold() > 0`), which a Trainer run does not;
- max_split_size_mb, roundup_power2_divisions, pinned_* and the cudaMallocAsync backend: not replayed, refused
  in one line (an answer would be the default allocator's);
- release_lock_on_cudamalloc, graph_capture_record_stream_reuse: change no bytes; accepted.
"""

from __future__ import annotations

from pipeline.core.errors import UserError
from pipeline.core.text import short

REPLAYED = ("expandable_segments",)
NOTED = {"garbage_collection_threshold": "garbage_collection_threshold acts only when the process sets a memory "
                                         "fraction (torch.cuda.set_per_process_memory_fraction), which a Trainer run "
                                         "does not: the answer is the allocator's without it"}
NO_BYTES = ("release_lock_on_cudamalloc", "graph_capture_record_stream_reuse")
REFUSED = {"max_split_size_mb": "max_split_size_mb (blocks above it never split)",
           "roundup_power2_divisions": "roundup_power2_divisions (requests rounded up to power-of-2 divisions)",
           "backend": "another allocator backend (cudaMallocAsync)",
           "pinned_use_cuda_host_register": "pinned host memory settings",
           "pinned_num_register_threads": "pinned host memory settings",
           "pinned_use_background_threads": "pinned host memory settings",
           "per_process_memory_fraction": "a memory fraction"}
MAX_TEXT = 1000


def read_alloc_conf(text) -> dict:
    """{"expandable_segments": bool, "notes": [...]} of a PYTORCH_CUDA_ALLOC_CONF text; one-line UserError for a
    key not replayed or not known."""
    if not isinstance(text, str) or len(text) > MAX_TEXT:
        raise UserError(f"alloc_conf must be PYTORCH_CUDA_ALLOC_CONF's text (key:value,...), not {short(text)}")
    settings, notes = {}, []
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, _, value = item.partition(":")
        key, value = key.strip(), value.strip()
        if key in REFUSED:
            raise UserError(f"PYTORCH_CUDA_ALLOC_CONF: {REFUSED[key]} is not replayed (the default allocator's "
                            "answer would be wrong for it)")
        if key == "expandable_segments":
            if value.lower() not in ("true", "false"):
                raise UserError("PYTORCH_CUDA_ALLOC_CONF: expandable_segments must be True or False, not "
                                f"{short(value)}")
            settings["expandable_segments"] = value.lower() == "true"
        elif key in NOTED:
            try:
                threshold = float(value)
            except ValueError:
                threshold = -1.0
            if not 0 < threshold < 1:
                raise UserError(f"PYTORCH_CUDA_ALLOC_CONF: {key} must be between 0 and 1, not {short(value)}")
            notes.append(f"PYTORCH_CUDA_ALLOC_CONF: {NOTED[key]}")
        elif key not in NO_BYTES:
            raise UserError(f"PYTORCH_CUDA_ALLOC_CONF: unknown key {short(key)}")
    return {"expandable_segments": settings.get("expandable_segments", False), "notes": notes}
