"""Stage: upload the dataset folder and coefficients.json to a Hugging Face dataset repo.

The token comes from HF_TOKEN or the huggingface_hub login and is handed to huggingface_hub only:
it is never printed, logged or written. A dry run lists what would be uploaded.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from pipeline.core.paths import COEFFICIENTS, DATASET
from pipeline.core.errors import UserError

REPO_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*"


def upload_plan(dataset_dir, coefficients=None) -> list[dict]:
    """What would be uploaded: {path_in_repo, local_path, bytes} for every file, in upload order."""
    dataset_dir = Path(dataset_dir)
    if not (dataset_dir / "README.md").is_file():
        raise UserError(f"{dataset_dir}: not a dataset folder (no README.md); run the dataset stage first")
    plan = [
        {"path_in_repo": path.relative_to(dataset_dir).as_posix(), "local_path": str(path), "bytes": path.stat().st_size}
        for path in sorted(dataset_dir.rglob("*"))
        if path.is_file() and not path.name.startswith(".")
    ]
    if coefficients:
        coefficients = Path(coefficients)
        if not coefficients.is_file():
            raise UserError(f"{coefficients}: coefficients file not found")
        plan.append({"path_in_repo": "coefficients.json", "local_path": str(coefficients),
                     "bytes": coefficients.stat().st_size})
    return plan


def find_token() -> str | None:
    import os

    from huggingface_hub import get_token

    return os.environ.get("HF_TOKEN") or get_token()


def publish(dataset_dir, repo: str, coefficients=None, dry_run: bool = False) -> dict:
    """Upload (or, dry run, only list) the dataset; returns a manifest without any secret in it."""
    if not re.fullmatch(REPO_PATTERN, repo) or ".." in repo:
        raise UserError(f"repo {repo!r} is not of the form owner/name")
    plan = upload_plan(dataset_dir, coefficients)
    manifest = {"repo": repo, "repo_type": "dataset", "dry_run": dry_run,
                "files": [{k: item[k] for k in ("path_in_repo", "bytes")} for item in plan],
                "total_bytes": sum(item["bytes"] for item in plan)}
    if dry_run:
        return manifest
    token = find_token()
    if not token:
        raise UserError("publishing needs a Hugging Face token: set HF_TOKEN or run `hf auth login`")
    manifest["commit_url"] = _upload(plan, dataset_dir, repo, token)
    return manifest


def _upload(plan: list[dict], dataset_dir, repo: str, token: str) -> str:
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    api.create_repo(repo, repo_type="dataset", exist_ok=True)
    commit = api.upload_folder(folder_path=str(dataset_dir), repo_id=repo, repo_type="dataset",
                               commit_message="Update dataset", ignore_patterns=[".*"])
    extra = [item for item in plan if item["path_in_repo"] == "coefficients.json"]
    if extra:
        commit = api.upload_file(path_or_fileobj=extra[0]["local_path"], path_in_repo="coefficients.json",
                                 repo_id=repo, repo_type="dataset", commit_message="Update coefficients")
    return str(getattr(commit, "commit_url", commit))


def add_cli(subparsers) -> None:
    parser = subparsers.add_parser("publish", help="upload the dataset folder to a Hugging Face dataset repo")
    parser.add_argument("--dataset", default=DATASET)
    parser.add_argument("--coefficients", default=COEFFICIENTS)
    parser.add_argument("--repo", required=True, help="dataset repo, owner/name")
    parser.add_argument("--dry-run", action="store_true", help="list what would be uploaded, upload nothing")
    parser.add_argument("--manifest", default=None, help="write what was (or would be) uploaded as JSON here")
    parser.set_defaults(handler=_publish_command)


def _publish_command(args) -> int:
    from pipeline.core.io import output_path, write_json

    if args.manifest:
        output_path(args.manifest)  # a bad manifest path is refused before anything is uploaded
    try:
        manifest = publish(args.dataset, args.repo, args.coefficients, args.dry_run)
    except UserError:
        raise
    # The exception's text is not shown: a Hub error can echo request details.
    except Exception as exc:  # noqa: BLE001 - any Hub or network failure: one line, no traceback
        print(f"error: upload to {args.repo} failed ({type(exc).__name__}); nothing was published",
              file=sys.stderr)
        return 1
    verb = "would upload" if args.dry_run else "uploaded"
    for item in manifest["files"]:
        print(f"{item['bytes']:>12,d}  {item['path_in_repo']}")
    print(f"publish: {verb} {len(manifest['files'])} files ({manifest['total_bytes']:,d} bytes) "
          f"to datasets/{args.repo}" + (f" ({manifest['commit_url']})" if "commit_url" in manifest else ""))
    if args.manifest:
        write_json(manifest, args.manifest)
    return 0
