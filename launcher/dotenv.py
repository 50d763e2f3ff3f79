"""A `.env` file in the working directory: the variables it sets fill in the environment.

The launcher reads it before its flags, so a setting comes from the command line first, then the
environment, then the file, then the built-in default. python-dotenv reads it (its syntax: quotes,
`export `, comments, multi-line quoted values, escapes in double quotes, ${VAR} taken from the
environment first, then from the file's earlier lines), except that a single-quoted value is kept
as written, as shells and docker compose keep it (python-dotenv would expand ${VAR} in it too: a
key or password holding `${` would change silently). Any variable may be set: the flags' own
(MODEL_ID, PORT, ...), TGI's DEFAULT_* and the others docs/operations.md lists. A line python-dotenv
cannot read, or a name without `=VALUE`, is an error that names it: a setting silently ignored
would be worse.
"""
from __future__ import annotations

import io
import os
import re
from pathlib import Path

from dotenv.main import DotEnv
from dotenv.parser import parse_stream

_SINGLE_QUOTED = re.compile(r"\s*(?:export\s+)?[^=]*=\s*'")


def check_dotenv(text: str, source: str = ".env") -> None:
    """Refuses a line python-dotenv cannot parse, and a bare name (python-dotenv would skip it)."""
    for binding in parse_stream(io.StringIO(text)):
        if binding.error or (binding.key is not None and binding.value is None):
            # python-dotenv's binding begins with the blank lines before it
            lines = binding.original.string.splitlines() or [""]
            blank = next((i for i, line in enumerate(lines) if line.strip()), 0)
            raise ValueError(f"{source}:{binding.original.line + blank}: expected KEY=VALUE, "
                             f"got {lines[blank]!r}")


def load_dotenv(path: Path) -> list[str]:
    """Sets each variable of the file that the environment does not set yet; returns their names."""
    if not path.is_file():
        return []
    text = path.read_text()
    check_dotenv(text, str(path))
    literal = _values(text, interpolate=False)
    single_quoted = {binding.key for binding in parse_stream(io.StringIO(text))
                     if binding.key is not None and _SINGLE_QUOTED.match(binding.original.string)}
    added = []
    for name, value in _values(text, interpolate=True).items():
        if name not in os.environ and value is not None:
            os.environ[name] = literal[name] if name in single_quoted else value
            added.append(name)
    return added


def _values(text: str, *, interpolate: bool) -> dict[str, str | None]:
    # override=False: in ${VAR}, the environment wins over the file
    return DotEnv(None, stream=io.StringIO(text), interpolate=interpolate, override=False).dict()
