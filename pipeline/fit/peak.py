"""The fit of the closed-form peak (`pipeline.formulas.peak`): the saved bytes per token of each
precision group, read off the measured backward peaks where its start dominates."""

from __future__ import annotations

from pipeline.core.vocabulary import WEIGHT_BYTES
from pipeline.fit.regression import fit_terms, public
from pipeline.formulas.peak import (SAME_TENSORS_AS, TERMS, branches, known_attention, known_saved_bytes, peak_group,
                                   saved_design)

START_DOMINATES = 2.0  # fit points: saved part of the backward peak above this many gradients


def peak_table(peaks, facts):
    """ok peaks of the standard step with the exact parts and the saved bytes read off the backward peak."""
    keep = (peaks["status"] == "ok") & peaks["peak_allocated_bytes"].notna() & peaks["model_id"].isin(facts)
    if "variant" in peaks.columns:
        keep &= peaks["variant"].fillna("standard") == "standard"
    rows = peaks[keep].copy()
    rows["gradient_checkpointing"] = rows["gradient_checkpointing"].fillna(False).astype(bool)
    rows["group"] = [peak_group(p, c) for p, c in zip(rows["precision"], rows["gradient_checkpointing"])]
    if "attn_implementation" not in rows.columns:
        rows["attn_implementation"] = None
    known, saved = [], []
    for r in rows.itertuples():
        parts = branches(facts[r.model_id], float(r.parameters), int(r.batch_size), int(r.seq_len), r.precision,
                         r.optimizer, bool(r.gradient_checkpointing), 0.0)
        base = parts["parameters"] + parts["optimizer_state"] + parts["workspaces"] + parts["loss_backward"]
        known.append(base + parts["activations"])
        backward = r.backward_peak_bytes if "backward_peak_bytes" in rows.columns else float("nan")
        saved.append(float(backward) - base if backward == backward else float("nan"))
    rows["known_bytes"] = known  # the backward branch without the fitted saved bytes
    rows["saved_bytes"] = saved  # read off the measured backward peak (amp copies included)
    rows["weight_bytes"] = [WEIGHT_BYTES[p] * n for p, n in zip(rows["precision"], rows["parameters"])]
    return rows.reset_index(drop=True)


def fit_peak(rows, facts, counted: dict | None = None, **run) -> dict:
    """Per group: the saved bytes per token on points where the start of the backward is the backward peak.

    A term that no measured point has (a layer no measured model has, such as a linear attention before its
    GPU sweep) takes the coefficient of the counted saved bytes of the group's precision (`counted`:
    {precision: {term: bytes per element}}); `counted_terms` names them."""
    import numpy as np

    fits = {}
    for group, part in rows.groupby("group"):
        part = part[part["saved_bytes"] > START_DOMINATES * part["weight_bytes"]]
        if part["model_id"].nunique() < 3:
            continue
        x = [[int(r.batch_size) * int(r.seq_len) * v for v in
              saved_design(facts[r.model_id], int(r.seq_len), r.precision, bool(r.gradient_checkpointing),
                           known_attention(r.attn_implementation))] for r in part.itertuples()]
        known = [known_saved_bytes(facts[r.model_id], r.precision, bool(r.gradient_checkpointing),
                                   int(r.batch_size) * int(r.seq_len)) for r in part.itertuples()]
        y = part["saved_bytes"].to_numpy(float) - known
        offset = part["known_bytes"].to_numpy(float)
        fit = fit_terms(x, y, part["family"], part["model_id"], TERMS, offset=offset, **run)
        everywhere = rows[rows["group"] == group]
        measured = np.array([saved_design(facts[r.model_id], int(r.seq_len), r.precision, bool(r.gradient_checkpointing))
                             for r in everywhere.itertuples()], float)
        unseen = [t for t, column in zip(TERMS, measured.T) if not column.any()]
        precision = part["precision"].iloc[0]
        fallback = (counted or {}).get(SAME_TENSORS_AS.get(precision, precision), {})
        fit["counted_terms"] = [t for t in unseen if t in fallback]
        fit["coefficients"].update({t: fallback[t] for t in fit["counted_terms"]})
        fit["metrics_of"] = ("the backward peak of the points where its start dominates (saved part above "
                             f"{START_DOMINATES} x the gradients), fitted by least squares of its relative error")
        fit["units"] = {"y": "bytes saved for backward (amp copies and the soft cap apart), read off the measured "
                             "backward peak",
                        "c": "bytes per feature unit per token"}
        fits[group] = public(fit)
    return fits
