"""The coefficient file (results/coefficients.json): its schema, reading, checking and writing,
and the parts of it that describe the heuristic estimator without any fitting.

The file is plain JSON that anyone can use without this code; its layout is
`coefficients.schema.json` beside this module. `python -m pipeline fit` writes it.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.core.errors import UserError
from pipeline.core.io import parse_json, read_input_text
from pipeline.formulas.components import (ACTIVATION_BYTES, AMP_WEIGHT_COPY_BYTES, INTERMEDIATE_BUFFERS, STATE_BUFFERS,
                               WEIGHT_BYTES)
from pipeline.core.paths import COEFFICIENTS
from pipeline.core.vocabulary import PRECISIONS

SCHEMA_VERSION = 2  # 2: the closed-form activation formula ('activation_formula')
SCHEMA_PATH = Path(__file__).with_name("coefficients.schema.json")


def load_schema() -> dict:
    return json.loads(SCHEMA_PATH.read_text())


def check_coefficients(data, label: str = "coefficients") -> dict:
    """The dict if it is a coefficient file of this schema version; one-line UserError otherwise."""
    import jsonschema

    if not isinstance(data, dict):
        raise UserError(f"{label}: not a coefficient file (expected a JSON object)")
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise UserError(f"{label}: coefficient file schema_version {version!r} is not supported (this code reads "
                        f"{SCHEMA_VERSION}); remake it with `python -m pipeline fit`")
    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(load_schema()).iter_errors(data))
    if error is not None:
        where = ".".join(str(p) for p in error.absolute_path) or "(top level)"
        raise UserError(f"{label}: field '{where}': {error.message.splitlines()[0][:200]}")
    return data


def load_coefficients(path) -> dict:
    """Read a coefficient file; one-line UserError for a missing, unreadable, corrupted or other-version file."""
    path = Path(path)
    text = read_input_text(path, "coefficient file not found (make it with `python -m pipeline fit`)",
                           "coefficient file is not readable")
    data = parse_json(text, str(path), "coefficient file is not valid JSON; it may be corrupted")
    return check_coefficients(data, str(path))


def resolve_coefficients(coefficients) -> dict:
    """A coefficient dict: given (trusted as loaded), from a path, or from the default path."""
    if isinstance(coefficients, dict):
        return coefficients
    if coefficients is None:
        if not COEFFICIENTS.is_file():
            raise UserError(f"{COEFFICIENTS}: no coefficient file; run `python -m pipeline fit` "
                            "or pass --coefficients PATH")
        coefficients = COEFFICIENTS
    return load_coefficients(coefficients)


def write_coefficients(coefficients: dict, path) -> None:
    from pipeline.core.io import write_json

    check_coefficients(json.loads(json.dumps(coefficients)), "coefficients to write")
    write_json(coefficients, path)


def estimator_structure() -> dict:
    """How the heuristic estimator combines the fit and the constants, so that the file stands alone."""
    return {
        "formula": "peak = weights + optimizer_state + gradients + max(optimizer_intermediates, activations); "
                   "weights = gradients = N_total x bytes_per_parameter; "
                   "optimizer_state = optimizer_state_buffers x N_total x bytes_per_parameter; "
                   "optimizer_intermediates = optimizer_intermediate_buffers x N_total x bytes_per_parameter; "
                   "activations = activation_multiplier x (a x N + b) x B x L x bytes_per_activation_element "
                   "[x checkpointing_factor] + weight_copy_bytes_per_parameter x N_total",
        "bytes_per_parameter": dict(WEIGHT_BYTES),
        "optimizer_state_buffers": dict(STATE_BUFFERS),
        "optimizer_intermediate_buffers": dict(INTERMEDIATE_BUFFERS),
        "bytes_per_activation_element": dict(ACTIVATION_BYTES),
        "weight_copy_bytes_per_parameter": {p: AMP_WEIGHT_COPY_BYTES.get(p, 0) for p in PRECISIONS},
    }


# reserved / allocated peak: the median over the committed H200 ok rows of the tuned-on models (every
# model but every 5th by id) is 1.068 (90th percentile 1.18), used where a coefficient file has none.
# The median: a higher quantile turns more right "fits" of blog and heuristic into wrong "does not fit"
# (their own errors on the allocated peak are far larger than the spread of this ratio).
RESERVED_RATIO_QUANTILE = 0.5
BUILT_IN_RESERVED_RATIO = {"value": 1.068, "n_points": 0,
                           "how": "built in: median of peak_reserved / peak_allocated on the H200 ok rows"}


def reserved_ratio(coefficients: dict | None) -> dict:
    """The closed-form estimators' reserved/allocated ratio: the coefficient file's, else the built-in one."""
    if coefficients is None:
        return BUILT_IN_RESERVED_RATIO
    return coefficients.get("estimator", {}).get("reserved_ratio") or BUILT_IN_RESERVED_RATIO


def default_constants() -> dict:
    """The estimator's empirical constants when no peak table measured them."""
    return {
        "activation_multiplier": {p: {"value": 1.0, "n_points": 0, "how": "not measured (no peak table)"}
                                  for p in PRECISIONS},
        "checkpointing_factor": {"value": None, "n_points": 0, "how": "not measured (no peak table)"},
        "reserved_ratio": BUILT_IN_RESERVED_RATIO,
    }
