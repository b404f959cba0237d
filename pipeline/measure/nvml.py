"""NVML: the process's memory as the driver sees it (the CUDA context and the allocator's cache)."""

from __future__ import annotations

import os

_NVML = {"ready": None}


def _nvml():
    if _NVML["ready"] is None:
        try:
            import pynvml

            pynvml.nvmlInit()
            _NVML["ready"] = pynvml
        except Exception:  # noqa: BLE001 - NVML is optional
            _NVML["ready"] = False
    return _NVML["ready"]


def nvml_columns(device: str) -> dict:
    """`nvml_used_bytes` (this process, None where NVML cannot see it, e.g. in a PID namespace)
    and `nvml_device_used_bytes` (the whole GPU)."""
    pynvml = _nvml() if device == "cuda" else None
    if not pynvml:
        return {"nvml_used_bytes": None, "nvml_device_used_bytes": None}
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        for handle in handles:
            for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if process.pid == os.getpid():
                    return {"nvml_used_bytes": process.usedGpuMemory,
                            "nvml_device_used_bytes": pynvml.nvmlDeviceGetMemoryInfo(handle).used}
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        index = int(visible) if visible.isdigit() else (0 if len(handles) == 1 else None)
        used = pynvml.nvmlDeviceGetMemoryInfo(handles[index]).used if index is not None else None
        return {"nvml_used_bytes": None, "nvml_device_used_bytes": used}
    except Exception:  # noqa: BLE001
        return {"nvml_used_bytes": None, "nvml_device_used_bytes": None}
