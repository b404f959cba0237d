"""Provenance columns that every measured or computed row carries."""

from __future__ import annotations

import functools
import os
import platform
import subprocess
from importlib import metadata

from pipeline.core.paths import REPO_ROOT

PACKAGE_VERSION = "0.1.0"  # the project's version (pyproject.toml says the same)


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


@functools.cache
def git_commit() -> str:
    """The project's commit; `AVP_GIT_COMMIT` overrides it where the tree is a copy without .git."""
    if os.environ.get("AVP_GIT_COMMIT"):
        return os.environ["AVP_GIT_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if out.returncode != 0:
        return "unknown"
    commit = out.stdout.strip()
    dirty = subprocess.run(  # the pipeline's own outputs under results/ change as it runs: not code
        ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)results"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=10,
    ).stdout.strip()
    return commit + ("-dirty" if dirty else "")


def software() -> dict:
    """Library versions. Importing torch is left to the caller's stage (it is slow)."""
    import torch

    return {
        "torch_version": torch.__version__,
        "transformers_version": _version("transformers"),
        "cuda_version": torch.version.cuda,
        "python_version": platform.python_version(),
        "git_commit": git_commit(),
    }


def device_info() -> dict:
    """Name of the device the numbers come from: the GPU when CUDA is in use, else the CPU."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return {"device": torch.cuda.get_device_name(), "driver_version": _nvidia_driver()}
    return {"device": f"cpu ({platform.machine()})", "driver_version": None}


def _nvidia_driver() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlSystemGetDriverVersion()
    except Exception:  # noqa: BLE001 - NVML is optional provenance
        return None


def provenance(include_device: bool = True) -> dict:
    row = software()
    if include_device:
        row.update(device_info())
    return row
