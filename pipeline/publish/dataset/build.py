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
    check_output_folder(out_dir, results_dir)
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
        write_manifest(staging)
        _replace_dir(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return tables


MANIFEST = ".dataset-files.json"  # the files a build wrote: the only ones a later build may replace
# What a dataset folder holds (the layout of a folder built before the manifest existed).
LAYOUT = ("README.md", "data/*.parquet", "figures/*.png")


def check_output_folder(out_dir: Path, results_dir: Path) -> None:
    """`out_dir` may be replaced: absent, empty, or holding only what a dataset build wrote; never a
    file, the results folder or a folder that holds it (one line, exit 2, nothing touched)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"{out_dir}: is a file, not a dataset folder")
    out, results = out_dir.resolve(), results_dir.resolve()
    if out == results or out in results.parents:
        raise UserError(f"--out {out_dir} would replace the results folder {results_dir}; give a folder of its own")
    if not out_dir.is_dir():
        return
    foreign = sorted(str(p.relative_to(out_dir)) for p in out_dir.rglob("*")
                     if p.is_file() and str(p.relative_to(out_dir)) not in owned_files(out_dir))
    if foreign:
        raise UserError(f"--out {out_dir} holds files a dataset build did not write ({foreign[0]}"
                        f"{f' and {len(foreign) - 1} more' if len(foreign) > 1 else ''}); give an empty or new folder")


def owned_files(folder: Path) -> set[str]:
    """The files of `folder` that a dataset build wrote (its manifest; else its layout)."""
    import json

    manifest = folder / MANIFEST
    if manifest.is_file():
        try:
            return {*json.loads(manifest.read_text()), MANIFEST}
        except (ValueError, TypeError):
            return set()
    return {str(p.relative_to(folder)) for pattern in LAYOUT for p in folder.glob(pattern) if p.is_file()}


def write_manifest(folder: Path) -> None:
    import json

    files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    (folder / MANIFEST).write_text(json.dumps(files, indent=1) + "\n")


def _replace_dir(new: Path, target: Path) -> None:
    old = None
    if target.exists():
        old = Path(tempfile.mkdtemp(prefix=f".tmp-old-{target.name}.", dir=target.parent))
        target.rename(old / target.name)
    new.rename(target)
    if old:
        shutil.rmtree(old, ignore_errors=True)
