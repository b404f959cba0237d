"""Build the dataset folder: the subsets as parquet, the figures and the card, replacing the folder whole."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from pipeline.publish.dataset.card import DEFAULT_REPO, dataset_card
from pipeline.publish.dataset.columns import undocumented_columns
from pipeline.publish.dataset.subsets import load_tables
from pipeline.core.errors import UserError


def build_dataset(results_dir="results", out_dir="results/dataset", repo: str = DEFAULT_REPO,
                  figures_dir=None) -> dict:
    """Write the subsets, figures and card into `out_dir` (replaced whole, never half-written)."""
    from pipeline.core.io import write_parquet, write_text

    results_dir, out_dir = Path(results_dir), Path(out_dir)
    tables = load_tables(results_dir)
    missing = undocumented_columns(tables)
    if missing:
        raise UserError(f"column(s) without a description in pipeline/publish/dataset/columns.py COLUMNS: {', '.join(missing)}")
    figures = sorted(Path(figures_dir or results_dir / "figures").glob("*.png"))
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".tmp-{out_dir.name}.", dir=out_dir.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the dataset is for everyone
    try:
        for subset, frame in tables.items():
            write_parquet(frame, staging / "data" / f"{subset}.parquet")
        for figure in figures:
            (staging / "figures").mkdir(exist_ok=True)
            shutil.copyfile(figure, staging / "figures" / figure.name)
        summary_path = results_dir / "validation_summary.md"
        summary = summary_path.read_text() if summary_path.exists() else None
        write_text(dataset_card(tables, repo, [f.name for f in figures], summary), staging / "README.md")
        _replace_dir(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return tables


def _replace_dir(new: Path, target: Path) -> None:
    old = None
    if target.exists():
        old = Path(tempfile.mkdtemp(prefix=f".tmp-old-{target.name}.", dir=target.parent))
        target.rename(old / target.name)
    new.rename(target)
    if old:
        shutil.rmtree(old, ignore_errors=True)
