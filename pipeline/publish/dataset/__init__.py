"""Stage: the published dataset — one parquet table per subset under `results/dataset/data/`,
the figures, and a dataset card (`README.md`) that `datasets.load_dataset` reads.

Every column of every table must be described in `columns.COLUMNS` (unit and meaning): a column
without a description fails the build, so the card cannot fall behind the tables. `subsets` reads
the stage outputs, `card` writes the card, `failures` lists what could not be counted or measured,
`build` writes the folder (replaced whole), `cli` is the `dataset` command.
"""

from pipeline.publish.dataset.build import build_dataset
from pipeline.publish.dataset.card import (BLOG_TITLE, BLOG_URL, DEFAULT_REPO, card_header, coefficients_markdown,
                                   dataset_card, size_category, validation_markdown)
from pipeline.publish.dataset.cli import add_cli
from pipeline.publish.dataset.columns import COLUMNS, PROVENANCE, SUBSET_COLUMNS, column_doc, undocumented_columns
from pipeline.publish.dataset.failures import failure_line, failure_report, failures
from pipeline.publish.dataset.subsets import SUBSETS, coefficients_table, load_tables

__all__ = [
    "BLOG_TITLE", "BLOG_URL", "COLUMNS", "DEFAULT_REPO", "PROVENANCE", "SUBSETS", "SUBSET_COLUMNS", "add_cli",
    "build_dataset", "card_header", "coefficients_markdown", "coefficients_table", "column_doc", "dataset_card",
    "failure_line", "failure_report", "failures", "load_tables", "size_category", "undocumented_columns",
    "validation_markdown",
]
