"""Activations vs parameters: measured activations and training-memory peaks of causal LMs.

The data flows one way through layers (docs/architecture.md): plumbing -> inputs (registry,
configs, modeling) -> measuring (activations, memory and sweep, simulate) -> knowledge (formulas,
coefficients, fit) -> answers (estimate, validate) -> outputs (figures, dataset, publish).
"""

from pipeline.provenance import PACKAGE_VERSION as __version__  # noqa: F401
