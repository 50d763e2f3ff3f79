"""PEFT's rank_pattern and alpha_pattern keys, matched against module names in bounded time.

PEFT gives a module the value of the first key for which re.match(rf"(.*\\.)?({key})$", name)
holds. Python's re backtracks, so a key such as `(.*.*)*x` would hold the shard (and the
interpreter) for minutes. Here a plain key (a module name, its dots matching any character as
they do in PEFT's regex) is compared at the one place it can end, and any other key runs in
time linear in the name (shard/adapters/linear_regex.py); the work of one adapter's keys is
capped. A key beyond that matcher's syntax or budget refuses the adapter, naming the key.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from shard.adapters.linear_regex import Budget, LinearRegex, RegexError, shown

MAX_KEYS = 4096  # keys of one pattern (PEFT's EVA writes one per module)
MAX_KEY_CHARS = 512
# the matching one adapter's patterns may cost (linear_regex's units: a character stepped is 1;
# a million are about half a second of Python, off the engine thread)
MAX_WORK = 1_000_000
# a plain key: a module name, whose dots PEFT's regex reads as "any character"
_PLAIN = re.compile(r"[A-Za-z0-9_\-.]+")


class PatternError(ValueError):
    """A key refused: its syntax, its size, or the work matching it took."""


def pattern_budget() -> Budget:
    """The matching work one adapter's rank_pattern and alpha_pattern may do together."""
    return Budget(MAX_WORK)


@dataclass(slots=True)
class _PlainKey:
    """A module name as a key: it can only end the name, at len(key) from its end."""

    key: str
    exact: re.Pattern  # the key with each dot matching any character (no repeat: linear)

    def matches(self, name: str, budget: Budget) -> bool:
        budget.spend(1, self.key)
        start = len(name) - len(self.key)
        if start < 0 or (start > 0 and name[start - 1] != "."):
            return False
        return self.exact.fullmatch(name, start) is not None


class ModulePatterns:
    """One pattern of an adapter's config (rank_pattern or alpha_pattern), ready to match."""

    def __init__(self, pattern: dict, field_name: str, budget: Budget):
        """PatternError for a key this matcher cannot take (its message names the field)."""
        self.field_name = field_name
        if len(pattern) > MAX_KEYS:
            raise PatternError(f"{field_name} has {len(pattern)} keys; at most {MAX_KEYS} are "
                               "taken")
        self._budget = budget
        self._keys: list[_PlainKey | LinearRegex] = []
        self._values = list(pattern.values())
        for key in pattern:
            if not isinstance(key, str) or not key or len(key) > MAX_KEY_CHARS:
                raise PatternError(f"{field_name}: key {shown(key)} must be a module name or a "
                                   f"regular expression of 1 to {MAX_KEY_CHARS} characters")
            try:
                self._keys.append(
                    _PlainKey(key, re.compile(re.escape(key).replace(r"\.", ".")))
                    if _PLAIN.fullmatch(key) else LinearRegex(key, budget))
            except RegexError as err:
                raise self._refused(err) from None

    def value(self, module: str, default):
        """The value of the first key that matches `module` (PEFT's order), else `default`."""
        try:
            for key, value in zip(self._keys, self._values):
                if key.matches(module, self._budget):
                    return value
        except RegexError as err:
            raise self._refused(err) from None
        return default

    def _refused(self, err: RegexError) -> PatternError:
        return PatternError(f"{self.field_name}: {err}; plain module names (such as q_proj or "
                            "model.layers.0.self_attn.q_proj) are always taken")
