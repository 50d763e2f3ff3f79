"""A `.env` file in the working directory: KEY=VALUE lines that fill in the environment.

The launcher reads it before its flags, so a setting comes from the command line first, then the
environment, then the file, then the built-in default. Lines may start with `export `, values may be
quoted; `#` starts a comment line. A malformed line is an error that names it (a silently ignored
setting would be worse).
"""
from __future__ import annotations

import os
from pathlib import Path


def parse_dotenv(text: str, source: str = ".env") -> dict[str, str]:
    values = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        line = line.removeprefix("export ").strip()
        key, sep, value = line.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key.replace("_", "").isalnum():
            raise ValueError(f"{source}:{number}: expected KEY=VALUE, got {raw!r}")
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        elif " #" in value:  # an unquoted value ends where a comment starts
            value = value[:value.index(" #")].rstrip()
        values[key] = value
    return values


def load_dotenv(path: Path) -> list[str]:
    """Sets each variable of the file that the environment does not set yet; returns their names."""
    if not path.is_file():
        return []
    added = []
    for key, value in parse_dotenv(path.read_text(), str(path)).items():
        if key not in os.environ:
            os.environ[key] = value
            added.append(key)
    return added
