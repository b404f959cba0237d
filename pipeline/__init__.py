"""Activations vs parameters: measured activations and training-memory peaks of causal LMs.

The data flows one way through layers (docs/architecture.md): plumbing -> inputs (registry,
configs, modeling) -> measuring (activations, memory and sweep, simulate) -> knowledge (formulas,
coefficients, fit) -> answers (estimate, validate) -> outputs (figures, dataset, publish).
"""

from pipeline.provenance import PACKAGE_VERSION as __version__  # noqa: F401

import logging as _logging

# bitsandbytes warns on import, on CPUs with AVX512-BF16, that an optional CPU 4-bit kernel package
# ("kernels") is missing; the simulator never runs that kernel, and the line would precede every
# QLoRA answer.
_logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(_logging.ERROR)
