"""Activations vs parameters: measured activations and training-memory peaks of causal LMs.

The package's folders are its layers, in the order the data flows (docs/architecture.md): core ->
inputs -> formulas -> training -> fit -> {activations, measure, simulate} -> estimate -> validate ->
publish, and the command line (`cli`).
"""

from pipeline.core.provenance import PACKAGE_VERSION as __version__  # noqa: F401

import logging as _logging

# bitsandbytes warns on import, on CPUs with AVX512-BF16, that an optional CPU 4-bit kernel package
# ("kernels") is missing; the simulator never runs that kernel, and the line would precede every
# QLoRA answer.
_logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(_logging.ERROR)


def __getattr__(name):
    """`pipeline.trace` (`pipeline.simulate.api.trace`: any training code, traced, on one GPU or as rank 0 of N),
    imported on first use: importing the package imports no torch."""
    if name == "trace":
        from pipeline.simulate.api import trace

        return trace
    raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
