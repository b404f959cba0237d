"""The `dataset` command."""

from __future__ import annotations

from pipeline.core.paths import DATASET, RESULTS
from pipeline.publish.dataset.build import build_dataset
from pipeline.publish.dataset.card import DEFAULT_REPO
from pipeline.publish.dataset.failures import failure_line, failures


def add_cli(subparsers) -> None:
    parser = subparsers.add_parser("dataset", help="build the Hugging Face dataset folder (parquet subsets + card)")
    parser.add_argument("--results", default=RESULTS, help="folder with the stage outputs")
    parser.add_argument("--out", default=DATASET)
    parser.add_argument("--figures", default=None, help="folder of PNG figures (default: RESULTS/figures)")
    parser.add_argument("--repo", default=DEFAULT_REPO, help="repo id shown in the card's loading example")
    parser.set_defaults(handler=_dataset_command)


def _dataset_command(args) -> int:
    tables = build_dataset(args.results, args.out, args.repo, args.figures)
    sizes = ", ".join(f"{subset}: {len(frame)}" for subset, frame in tables.items())
    print(f"dataset: {len(tables)} subsets -> {args.out} ({sizes})")
    for row in failures(tables).itertuples():
        print(f"failed: {failure_line(row)}")
    return 0
