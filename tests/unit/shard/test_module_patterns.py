"""rank_pattern / alpha_pattern keys: PEFT's answers, in bounded time whatever the key."""
import random
import re
import time

import pytest

from shard.adapters.module_patterns import (MAX_KEY_CHARS, MAX_KEYS, ModulePatterns,
                                            PatternError, pattern_budget)

NAMES = ["model.layers.0.self_attn.q_proj", "model.layers.12.self_attn.q_proj",
         "model.layers.1.mlp.down_proj", "model.layers.10.mlp.up_proj", "q_proj", "a.b", "aXb",
         "x.aXb"]


def _peft(key: str, name: str) -> bool:
    """PEFT's rule (peft.utils.other.get_pattern_key)."""
    return re.match(rf"(.*\.)?({key})$", name) is not None


def _random_key(rng: random.Random, depth: int = 0) -> str:
    atoms = ["a", "b", "q", "_", "1", "\\.", ".", "[ab]", "[^a]", "[a-c_]", "\\d", "\\w", "^", "$"]
    key = ""
    for _ in range(rng.randint(1, 4)):
        atom = rng.choice(atoms)
        if depth < 3 and rng.random() < 0.2:
            atom = "(" + rng.choice(["", "?:"]) + _random_key(rng, depth + 1) + ")"
        if atom not in ("^", "$") and rng.random() < 0.4:
            atom += rng.choice(["*", "+", "?", "{2}", "{1,3}", "{,2}", "{2,}", "*?", "{,}"])
        key += atom
    return key + ("|" + _random_key(rng, depth + 1) if depth < 3 and rng.random() < 0.2 else "")


def _agree(key: str, names: list[str]) -> int:
    patterns = ModulePatterns({key: 1}, "rank_pattern", pattern_budget())
    for name in names:
        assert (patterns.value(name, 0) == 1) == _peft(key, name), (key, name)
    return len(names)


def test_keys_match_as_peft_matches_them():
    keys = ["q_proj", "self_attn.q_proj", "layers.1.mlp.down_proj", "a.b", "layers\\.1\\d?\\.",
            "^model.layers.0.self_attn.q_proj", "q_proj|v_proj", ".*\\.mlp\\..*", "[]a]",
            "x{0}b"]
    checked = sum(_agree(key, NAMES) for key in keys)
    # random keys against short random names (re itself may backtrack long on longer ones)
    rng = random.Random(0)
    for _ in range(1500):
        key = _random_key(rng)
        try:
            re.compile(key)
        except re.error:
            continue
        checked += _agree(key, ["".join(rng.choice("ab.q_1x") for _ in range(rng.randint(1, 7)))
                                for _ in range(8)] + ["a.b", "aXb", "x.-", "a..b"])
    assert checked > 10000


def test_the_first_key_that_matches_gives_the_value():
    patterns = ModulePatterns({"q_proj": 16, ".*": 4, "layers.0.self_attn.q_proj": 2},
                              "rank_pattern", pattern_budget())
    assert patterns.value("model.layers.0.self_attn.q_proj", 8) == 16
    assert patterns.value("model.layers.0.mlp.up_proj", 8) == 4
    assert ModulePatterns({}, "rank_pattern", pattern_budget()).value("q_proj", 8) == 8


def test_a_backtracking_key_answers_at_once():
    """(.*.*)*x takes Python's re exponential time in the name's length; here it is linear."""
    patterns = ModulePatterns({"(.*.*)*x": 4, "(a|a)*(a|a)*b": 2}, "rank_pattern",
                              pattern_budget())
    started = time.monotonic()
    for layer in range(64):
        assert patterns.value(f"model.layers.{layer}.self_attn.q_proj" + ".aaaa" * 20, 8) == 8
    assert patterns.value("model.x", 8) == 4
    assert time.monotonic() - started < 1.0


@pytest.mark.parametrize("key, words", [
    ("(?=q)proj", "a lookaround"), ("(a)\\1", "the escape \\1"), ("(?i)q_proj", "flags"),
    ("a*+", "possessive"), ("a**", "repeated quantifier"), ("((((" * 10 + ")))" * 10, "deeper"),
    ("(a{100}){100}", "more than 2048 states"), ("(q_proj", "unclosed"), ("q)", "unmatched"),
    ("x" * 600, "of 1 to 512 characters"), ("", "of 1 to 512 characters"),
])
def test_keys_beyond_the_matcher_are_refused_naming_the_key(key, words):
    with pytest.raises(PatternError, match=re.escape(words)) as refused:
        ModulePatterns({key: 1}, "alpha_pattern", pattern_budget())
    assert str(refused.value).startswith("alpha_pattern: ") and len(str(refused.value)) < 600


def test_the_work_of_one_adapter_is_bounded():
    """Thousands of regular-expression keys (none matching, each a new automaton to build): the
    adapter is refused once its budget is spent, in about a second at most."""
    keys = {f"(.*.*)*x{i}|(a|b)*c{i}|[a-z_.0-9]*\\.{i}": i for i in range(MAX_KEYS)}
    started = time.monotonic()
    with pytest.raises(PatternError, match="takes too long"):
        patterns = ModulePatterns(keys, "rank_pattern", pattern_budget())
        for layer in range(100):
            patterns.value(f"model.layers.{layer}.self_attn.q_proj", 8)
    assert time.monotonic() - started < 5.0
    with pytest.raises(PatternError, match=f"at most {MAX_KEYS}"):
        ModulePatterns({f"k{i}": 1 for i in range(MAX_KEYS + 1)}, "rank_pattern",
                       pattern_budget())


def test_a_class_of_hundreds_of_ranges_counts_each_range_tested():
    """Wide classes in every state: the budget counts each range a character is tested against,
    so the adapter is refused within it (about ten times over it, when only states counted)."""
    wide = "".join(chr(0x100 + 2 * i) for i in range(420))
    keys = {f"[{wide}a-z0-9._]{{0,1000}}z{n}"[:MAX_KEY_CHARS]: 4 for n in range(40)}
    started = time.process_time()
    with pytest.raises(PatternError, match="takes too long"):
        patterns = ModulePatterns(keys, "rank_pattern", pattern_budget())
        for layer in range(80):
            for kind in "qkvoabc":
                patterns.value(f"model.layers.{layer}.self_attn.{kind}_proj", 8)
    assert time.process_time() - started < 2.5  # 5 s of CPU when only states counted


def test_a_key_for_every_module_of_a_large_model_is_cheap():
    """EVA writes one plain key per module: 80 layers' worth stays well within the budget."""
    kinds = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    names = [f"model.layers.{layer}.{kind}" for layer in range(80) for kind in kinds]
    patterns = ModulePatterns({name: i for i, name in enumerate(names)}, "rank_pattern",
                              pattern_budget())
    assert [patterns.value(name, -1) for name in names] == list(range(len(names)))
