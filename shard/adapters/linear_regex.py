"""A regular expression matched in time linear in the text: re's common syntax, no backtracking.

The expression is parsed into a Thompson NFA, run over the text a state set at a time, the state
sets cached as a lazy DFA's (`LinearRegex`). The syntax is re's common core: literals and
escapes, `.`, classes, groups, `|`, `* + ?` and `{m,n}` (lazy or not), `^` and `$`; more
(backreferences, lookarounds, flags, possessive quantifiers) is a RegexError, and so is an
expression whose NFA would be too large. The search is the one PEFT's pattern keys need
(shard/adapters/module_patterns.py): the expression matched to the text's end, starting at the
text's start or after any dot. Every step is counted against a `Budget`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

MAX_STATES = 2048  # NFA states of one expression, its {m,n} repeats unrolled
MAX_DEPTH = 32  # groups nested in an expression (the parser and the compiler recurse)
COMPILE_COST = 4  # the budget an NFA state costs to build, against 1 for a step


class RegexError(ValueError):
    """An expression refused: its syntax, its size, or the work matching it took."""


@dataclass(slots=True)
class Budget:
    """The matching work left to a set of expressions (one adapter's)."""

    left: int

    def spend(self, work: int, expression: str) -> None:
        """RegexError once the work is spent, naming the expression that spent the last of it."""
        self.left -= work
        if self.left < 0:
            raise RegexError(f"matching key {shown(expression)} takes too long")


_CHAR, _SPLIT, _BOL, _EOL, _MATCH = range(5)


@dataclass(frozen=True, slots=True)
class _Chars:
    """A character class: ranges of code points and \\d \\w \\s categories, possibly negated."""

    ranges: tuple[tuple[int, int], ...] = ()
    categories: tuple[str, ...] = ()  # d w s (their capitals: the complement)
    negated: bool = False

    def matches(self, char: str) -> bool:
        code = ord(char)
        inside = (any(low <= code <= high for low, high in self.ranges)
                  or any(_in_category(char, c) for c in self.categories))
        return inside != self.negated


def _in_category(char: str, category: str) -> bool:
    lower = category.lower()
    found = (char.isdecimal() if lower == "d" else char.isalnum() or char == "_" if lower == "w"
             else char.isspace())
    return found if category == lower else not found


_ANY = _Chars(((10, 10),), negated=True)  # re's `.`: anything but a newline


@dataclass(slots=True)
class _Nfa:
    kinds: list[int] = field(default_factory=list)
    chars: list[_Chars | None] = field(default_factory=list)
    out1: list[int] = field(default_factory=list)
    out2: list[int] = field(default_factory=list)

    def add(self, kind: int, chars: _Chars | None = None, out1: int = -1, out2: int = -1) -> int:
        self.kinds.append(kind)
        self.chars.append(chars)
        self.out1.append(out1)
        self.out2.append(out2)
        return len(self.kinds) - 1


class _Parser:
    """re's common syntax, parsed into a tree of tuples.

    (chars, c), (bol,), (eol,), (cat, [...]), (alt, [...]), (repeat, node, low, high or None).
    """

    def __init__(self, key: str):
        self.key, self.at, self.depth = key, 0, 0

    def parse(self):
        node = self._alternation()
        if self.at != len(self.key):  # only an unmatched ")" stops the top level early
            raise self._error("an unmatched ')'")
        return node

    def _error(self, what: str) -> RegexError:
        return RegexError(f"key {shown(self.key)}: {what} at character {self.at}; keys may use "
                          "literals, escapes, '.', classes, groups, '|', '*', '+', '?', "
                          "'{m,n}', '^' and '$'")

    def _peek(self, ahead: int = 0) -> str:
        index = self.at + ahead
        return self.key[index] if index < len(self.key) else ""

    def _alternation(self):
        branches = [self._sequence()]
        while self._peek() == "|":
            self.at += 1
            branches.append(self._sequence())
        return branches[0] if len(branches) == 1 else ("alt", branches)

    def _sequence(self):
        items = []
        while self._peek() not in ("", "|", ")"):
            atom = self._atom()
            items.append(self._quantified(atom))
        return ("cat", items)

    def _quantified(self, atom):
        bounds = self._quantifier()
        if bounds is None:
            return atom
        if atom[0] in ("bol", "eol"):
            raise self._error("a quantifier after an anchor")
        if self._peek() == "+":
            raise self._error("a possessive quantifier")
        if self._peek() == "?":  # lazy: the same strings match
            self.at += 1
        if self._quantifier() is not None:
            raise self._error("a repeated quantifier")
        return ("repeat", atom, *bounds)

    def _quantifier(self) -> tuple[int, int | None] | None:
        """The quantifier here (consumed), or None."""
        char = self._peek()
        if char in ("*", "+", "?"):
            self.at += 1
            return {"*": (0, None), "+": (1, None), "?": (0, 1)}[char]
        return self._braces() if char == "{" else None

    def _braces(self) -> tuple[int, int | None] | None:
        """{m}, {m,}, {,n} or {m,n} (consumed), or None where re reads a literal '{'."""
        found = re.match(r"\{(\d*)(,?)(\d*)\}", self.key[self.at:])
        if found is None or found[0] == "{}":
            return None
        low = int(found[1] or 0)
        high = None if found[2] and not found[3] else int(found[3] or found[1])
        if max(low, high or 0) > MAX_STATES or (high is not None and high < low):
            raise self._error(f"the repeat {found[0]}")
        self.at += len(found[0])
        return low, high

    def _atom(self):
        char = self._peek()
        self.at += 1
        if char == "(":
            if self._peek() == "?":
                named = re.match(r"\?P<[A-Za-z_]\w*>", self.key[self.at:])
                if self._peek(1) == ":":
                    self.at += 2
                elif named is not None:
                    self.at += len(named[0])
                else:
                    raise self._error("a group with flags, a lookaround or a reference")
            self.depth += 1
            if self.depth > MAX_DEPTH:
                raise self._error(f"groups nested deeper than {MAX_DEPTH}")
            node = self._alternation()
            if self._peek() != ")":
                raise self._error("an unclosed '('")
            self.at += 1
            self.depth -= 1
            return node
        if char in ("*", "+", "?"):
            raise self._error("nothing to repeat")
        if char == "[":
            return ("chars", self._class())
        if char == ".":
            return ("chars", _ANY)
        if char == "^":
            return ("bol",)
        if char == "$":
            return ("eol",)
        if char == "\\":
            return ("chars", self._escape())
        return ("chars", _literal(char))

    def _escape(self) -> _Chars:
        char = self._peek()
        self.at += 1
        if char and char in "dDwWsS":
            return _Chars(categories=(char,))
        if char and not char.isalnum() and char.isprintable():
            return _literal(char)
        raise self._error(f"the escape \\{char}")

    def _class(self) -> _Chars:
        negated = self._peek() == "^"
        self.at += negated
        ranges, categories, first = [], [], True
        while first or self._peek() != "]":
            if not self._peek():
                raise self._error("an unclosed '['")
            first = False
            low = self._class_char(categories)
            if low is None:
                continue
            if self._peek() == "-" and self._peek(1) not in ("]", ""):
                self.at += 1
                high = self._class_char(categories)
                if high is None or high < low:
                    raise self._error("a bad range in a class")
                ranges.append((low, high))
            else:
                ranges.append((low, low))
        self.at += 1
        return _Chars(tuple(ranges), tuple(categories), negated)

    def _class_char(self, categories: list[str]) -> int | None:
        """One character of a class as a code point, or None for a category it added."""
        char = self._peek()
        self.at += 1
        if char != "\\":
            return ord(char)
        escaped = self._escape()
        if escaped.categories:
            categories.extend(escaped.categories)
            return None
        return escaped.ranges[0][0]


def _literal(char: str) -> _Chars:
    return _Chars(((ord(char), ord(char)),))


def _size(node) -> int:
    """The NFA states `node` unrolls to."""
    kind = node[0]
    if kind in ("chars", "bol", "eol"):
        return 1
    if kind in ("cat", "alt"):
        return sum(_size(child) for child in node[1]) + len(node[1])
    _, body, low, high = node
    return (_size(body) + 1) * max(low, high or low + 1) + 1


def _compile(nfa: _Nfa, node, follow: int) -> int:
    """The states of `node` ahead of state `follow`; their start."""
    kind = node[0]
    if kind == "chars":
        return nfa.add(_CHAR, node[1], follow)
    if kind in ("bol", "eol"):
        return nfa.add(_BOL if kind == "bol" else _EOL, out1=follow)
    if kind == "cat":
        for child in reversed(node[1]):
            follow = _compile(nfa, child, follow)
        return follow
    if kind == "alt":
        starts = [_compile(nfa, child, follow) for child in node[1]]
        start = starts[-1]
        for other in reversed(starts[:-1]):
            start = nfa.add(_SPLIT, out1=other, out2=start)
        return start
    _, body, low, high = node
    if high is None:  # a loop: split -> body -> split, or on
        loop = nfa.add(_SPLIT, out2=follow)
        nfa.out1[loop] = _compile(nfa, body, loop)
        follow = loop
    else:
        for _ in range(high - low):
            follow = nfa.add(_SPLIT, out1=_compile(nfa, body, follow), out2=follow)
    for _ in range(low):
        follow = _compile(nfa, body, follow)
    return follow


class LinearRegex:
    """One expression's NFA and the DFA states its matching has met so far (numbered as met)."""

    def __init__(self, key: str, budget: Budget):
        tree = _Parser(key).parse()
        size = _size(tree)
        if size > MAX_STATES:
            raise RegexError(f"key {shown(key)} unrolls to more than {MAX_STATES} states")
        budget.spend(len(key) + COMPILE_COST * size, key)
        self.key = key
        self.work = 0  # NFA states visited building DFA states, not yet spent
        self.nfa = _Nfa()
        start = _compile(self.nfa, tree, self.nfa.add(_MATCH))
        self._sets: list[frozenset[int]] = []  # DFA state -> its NFA states
        self._numbers: dict[frozenset[int], int] = {}
        self._moves: list[dict[str, int]] = []  # DFA state -> character -> next DFA state
        self._accepts: list[bool | None] = []  # DFA state -> whether a name may end there
        self._later = self._closure([start], at_start=False)  # the key begun again after a dot
        self._first = self._number(self._closure([start], at_start=True))  # ^ holds at 0

    def matches(self, name: str, budget: Budget) -> bool:
        """PEFT's rule: (.*\\.)?(key)$ from the name's start."""
        state, moves = self._first, self._moves
        for char in name:
            following = moves[state].get(char)
            if following is None:
                following = self._number(self._step(self._sets[state], char))
                moves[state][char] = following
            state = following
        if self._accepts[state] is None:
            reached = self._closure(self._sets[state], at_start=not name, at_end=True)
            self._accepts[state] = any(self.nfa.kinds[s] == _MATCH for s in reached)
        budget.spend(len(name) + self.work, self.key)
        self.work = 0
        return self._accepts[state]

    def _number(self, states: frozenset[int]) -> int:
        number = self._numbers.get(states)
        if number is None:
            number = self._numbers[states] = len(self._sets)
            self._sets.append(states)
            self._moves.append({})
            self._accepts.append(None)
        return number

    def _step(self, states: frozenset[int], char: str) -> frozenset[int]:
        nfa, moved = self.nfa, []
        for state in states:
            if nfa.kinds[state] == _CHAR:
                chars = nfa.chars[state]
                # each range and category tested is work too: a class of hundreds of ranges
                # in every state would otherwise cost ten times what the budget counts
                self.work += 1 + len(chars.ranges) + len(chars.categories)
                if chars.matches(char):
                    moved.append(nfa.out1[state])
        after = self._closure(moved, at_start=False)
        # the key may start again after any dot: PEFT's (.*\.)? prefix
        return after | self._later if char == "." else after

    def _closure(self, states, *, at_start: bool, at_end: bool = False) -> frozenset[int]:
        """`states` and what they reach without reading (^ only at the start, $ only at the end)."""
        nfa, seen, stack = self.nfa, set(), list(states)
        while stack:
            state = stack.pop()
            if state in seen:
                continue
            seen.add(state)
            kind = nfa.kinds[state]
            if kind == _SPLIT:
                stack += (nfa.out1[state], nfa.out2[state])
            elif (kind == _BOL and at_start) or (kind == _EOL and at_end):
                stack.append(nfa.out1[state])
        self.work += len(seen)
        return frozenset(seen)


def shown(key: object) -> str:
    """An expression as a message shows it: quoted, and cut short when long."""
    text = repr(key)
    return text if len(text) <= 80 else f"{text[:77]}..."
