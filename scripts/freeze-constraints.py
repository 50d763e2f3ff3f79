"""Writes constraints.txt: the version installed in this environment of every package that
tgi-py[test] pulls in, directly or not. Run it with the environment's Python after installing a
change of pyproject.toml (`.venv/bin/python scripts/freeze-constraints.py`), then check the result
with `bash scripts/install.sh && .venv/bin/python -m pytest -q`."""
from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
HEADER = """\
# The exact versions that CI, the Dockerfile and scripts/install.sh install (`pip install -c`):
# every package tgi-py[test] pulls in, directly or not. pyproject.toml holds the ranges.
# Regenerate after installing a change: .venv/bin/python scripts/freeze-constraints.py
"""


def installed_closure(project: str, extras: set[str]) -> dict[str, str]:
    """name -> installed version of every distribution `project[extras]` requires, transitively."""
    versions: dict[str, str] = {}
    visited: set[tuple[str, frozenset[str]]] = set()
    pending = [(project, frozenset(extras))]
    while pending:
        name, wanted_extras = pending.pop()
        key = canonicalize_name(name)
        if (key, wanted_extras) in visited:
            continue
        visited.add((key, wanted_extras))
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            sys.exit(f"{name} is required but not installed: run scripts/install.sh first")
        versions[key] = dist.version
        for text in dist.requires or []:
            requirement = Requirement(text)
            marker = requirement.marker
            if marker is None or any(marker.evaluate({"extra": e}) for e in wanted_extras | {""}):
                pending.append((requirement.name, frozenset(requirement.extras)))
    return versions


def main() -> None:
    versions = installed_closure("tgi-py", {"test"})
    del versions["tgi-py"]
    # a local label names the build (torch 2.13.0+cpu); the pin admits every build of the release
    lines = [f"{name}=={version.split('+')[0]}" for name, version in sorted(versions.items())]
    (ROOT / "constraints.txt").write_text(HEADER + "\n".join(lines) + "\n")
    print(f"constraints.txt: {len(lines)} pins")


if __name__ == "__main__":
    main()
