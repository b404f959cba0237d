"""CI runs the README's commands as a newcomer types them (issue 26): `.ci/run` holds the README's fenced bash
commands of "Two commands", verbatim and in order, and besides them only what the README itself tells a
newcomer to do: the apt packages it names, the environment variables it names, and shell plumbing that runs
nothing (no pip, no python, no second install of torch)."""

from __future__ import annotations

import re

from conftest import REPO

CI = REPO / ".ci" / "run"
README = REPO / "README.md"
SECTION = "## Two commands"
# What CI adds to a README command: a failure inside an && list does not stop a script under errexit.
GUARD = " || exit 1"
PLUMBING = ('set -euo pipefail', 'cd "$(dirname "$0")/.."', 'if ! command -v chromium >/dev/null 2>&1; then',
            'SUDO=""', 'if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi', 'fi')
RUNS_SOMETHING = re.compile(r"\b(pip|pip3|python|python3|uv|conda|snakemake|pytest|torch|curl|wget)\b")


def readme_section() -> str:
    text = README.read_text()
    start = text.index(SECTION)
    end = text.index("\n## ", start + len(SECTION))
    return text[start:end]


def readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", readme_section(), re.S)
    return [line.strip() for block in blocks for line in block.splitlines()
            if line.strip() and not line.strip().startswith("#")]


def ci_lines() -> list[str]:
    return [line.strip() for line in CI.read_text().splitlines() if line.strip() and not line.strip().startswith("#")]


def apt_packages(line: str) -> set[str]:
    """The packages an `apt-get install` line names (options and variables left out)."""
    words = line.split("apt-get install", 1)[1].split()
    return {w.strip("`") for w in words if not w.startswith(("-", "$"))}


def readme_apt_packages() -> set[str]:
    return {p for mention in re.findall(r"`apt-get install ([^`]*)`", readme_section()) for p in mention.split()}


def extra_line_problem(line: str, section: str) -> str | None:
    """Why a line of .ci/run that is not a README command is not allowed (None: allowed)."""
    if line in PLUMBING:
        return None
    if "apt-get update" in line and not RUNS_SOMETHING.search(line):
        return None
    if "apt-get install" in line:
        extra = apt_packages(line) - readme_apt_packages()
        return f"installs {sorted(extra)}, which the README does not name" if extra else None
    export = re.fullmatch(r"export ([A-Z_][A-Z0-9_]*)=\S+", line)
    if export:
        return None if export.group(1) in section else f"sets {export.group(1)}, which the README does not mention"
    return "neither a README command nor what the README tells a newcomer to do"


def test_ci_runs_the_readmes_commands_verbatim_and_in_order():
    commands = readme_commands()
    assert commands == ["python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[workflow]' && "
                        "snakemake --cores 4", "pip install -e '.[dev]' && python -m pytest"]
    run = [line.removesuffix(GUARD) for line in ci_lines() if line.removesuffix(GUARD) in commands]
    assert run == commands


def test_ci_does_nothing_else_but_what_the_readme_tells():
    commands, section = readme_commands(), readme_section()
    problems = [f"{line!r}: {problem}" for line in ci_lines() if line.removesuffix(GUARD) not in commands
                for problem in [extra_line_problem(line, section)] if problem]
    assert problems == []
    assert not any(RUNS_SOMETHING.search(line) for line in ci_lines() if line.removesuffix(GUARD) not in commands)


def test_the_browser_setup_of_ci_is_the_readmes():
    """The README names chromium for the browser test and AVP_REQUIRE_BROWSER; CI installs it and sets it."""
    assert readme_apt_packages() == {"chromium"}
    assert "AVP_REQUIRE_BROWSER=1" in readme_section()
    lines = ci_lines()
    assert any("apt-get install" in line and apt_packages(line) == {"chromium"} for line in lines)
    assert "export AVP_REQUIRE_BROWSER=1" in lines


def test_the_checks_catch_what_ci_used_to_do():
    """The line CI ran before issue 26 (a CPU torch installed before the README's command) is refused."""
    section = readme_section()
    assert extra_line_problem('python -m pip install -q "torch==2.13.0"', section) is not None
    assert extra_line_problem("apt-get install -y chromium chromium-driver", section) is not None
    assert extra_line_problem("export TORCH_INDEX=cpu", section) is not None
