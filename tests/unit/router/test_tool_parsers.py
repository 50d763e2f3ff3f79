"""--tool-call-parser's formats and the grammar-forced JSON calls: whole outputs as vLLM's parsers
read them, and the same answer from a stream split at every character boundary."""
import json

import pytest

from router.inputs.tool_parsers import PARSERS, JsonCalls, check_tool_parser
from router.inputs.tool_parsers.events import merged


def _answer(deltas) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) the deltas add up to."""
    content, calls = "", {}
    for delta in deltas:
        content += delta.content
        if delta.index is not None:
            name, arguments = calls.get(delta.index, ("", ""))
            calls[delta.index] = (delta.name or name, arguments + delta.arguments)
    return content, [calls[i] for i in sorted(calls)]


def _whole(make, text):
    parser = make()
    return _answer(parser.feed(text) + parser.finish())


def _split(make, text, *cuts):
    parser, deltas = make(), []
    bounds = [0, *cuts, len(text)]
    for start, end in zip(bounds, bounds[1:]):
        deltas += parser.feed(text[start:end])
    return _answer(deltas + parser.finish())


WEATHER = '{"city": "Paris", "days": [1, 2], "note": "a \\"q\\" }"}'
CASES = [
    ("hermes", f'Let me look.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
     ("Let me look.", [("get_weather", WEATHER), ("get_time", "{}")])),
    ("hermes", "No tools here, < and <tool are text.\n",
     ("No tools here, < and <tool are text.\n", [])),
    ("llama3_json", f'{{"name": "get_weather", "parameters": {WEATHER}}}; '
                    '{"name": "get_time", "parameters": {"tz": "UTC"}}',
     ("", [("get_weather", WEATHER), ("get_time", '{"tz": "UTC"}')])),
    ("llama3_json", '<|python_tag|>{"name": "f", "arguments": {"x": 1}}', ("", [("f", '{"x": 1}')])),
    ("llama3_json", "It is sunny {not a call}", ("It is sunny {not a call}", [])),
    ("mistral", f'Sure.[TOOL_CALLS][{{"name": "get_weather", "arguments": {WEATHER}}}, '
                '{"name": "get_time", "arguments": {}}]',
     ("Sure.", [("get_weather", WEATHER), ("get_time", "{}")])),
    ("mistral", f"[TOOL_CALLS]get_weather[ARGS]{WEATHER}[TOOL_CALLS]get_time[ARGS]{{}}",
     ("", [("get_weather", WEATHER), ("get_time", "{}")])),
    ("mistral", "[TOOL no call", ("[TOOL no call", [])),
    ("pythonic", '[get_weather(city="Paris", days=[1, 2], note=\'a ) "q"\'), get_time()]',
     ("", [("get_weather", '{"city": "Paris", "days": [1, 2], "note": "a ) \\"q\\""}'),
           ("get_time", "{}")])),
    ("pythonic", "[1, 2] is a list", ("[1, 2] is a list", [])),
]


@pytest.mark.parametrize("name,text,expected", CASES)
def test_whole_outputs_and_streams_cut_anywhere_give_the_same_answer(name, text, expected):
    make = PARSERS[name]
    assert _whole(make, text) == expected
    for i in range(len(text) + 1):
        assert _split(make, text, i) == expected, i
    parser, deltas = make(), []
    for c in text:  # a character a token
        deltas += parser.feed(c)
    assert _answer(deltas + parser.finish()) == expected


def test_a_pythonic_call_nested_past_pythons_parser_is_no_call():
    """A model's `f(a=----...1)` once raised RecursionError (MemoryError deeper): a 500."""
    for deep in ("-" * 5000 + "1", "not " * 3000 + "True", "(" * 300 + "1" + ")" * 300):
        assert _whole(PARSERS["pythonic"], f"[f(a={deep}), g(b=1)]") == ("", [("g", '{"b": 1}')])


def test_a_calls_name_goes_out_first_and_alone_then_its_arguments_as_written():
    parser = PARSERS["hermes"]()
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    pieces = [merged(parser.feed(text[i:i + 4])) for i in range(0, len(text), 4)]
    flat = [d for piece in pieces for d in piece]
    assert flat[0].name == "get_weather" and flat[0].arguments == "" and flat[0].index == 0
    assert all(d.name is None and d.index == 0 for d in flat[1:])
    assert len(flat) > 3, "the arguments stream in pieces"


FORCED = [
    ('[{"name":"get_weather","arguments":{"city":"Pa\\"ris"}},{"name":"t","arguments":{}}]',
     ("", [("get_weather", '{"city":"Pa\\"ris"}'), ("t", "{}")])),
    ('{"name":"get_weather","arguments":{"city":"x"}}', ("", [("get_weather", '{"city":"x"}')])),
    ('{"name":"no_tool","arguments":{"content":"Hi \\u00e9\\ud83d\\ude00 \\"x\\"\\n"}}',
     ('Hi é😀 "x"\n', [])),
]


@pytest.mark.parametrize("text,expected", FORCED)
def test_grammar_forced_calls_stream_and_no_tool_is_the_answer_in_words(text, expected):
    def make():
        return JsonCalls(no_tool="no_tool")

    assert _whole(make, text) == expected
    for i in range(len(text) + 1):
        assert _split(make, text, i) == expected, i
    for name, arguments in expected[1]:
        json.loads(arguments)


@pytest.mark.parametrize("escaped,said", [
    ("\\ud83d\\u0041", "\ufffdA"), ("\\ud83d x", "\ufffd x"), ("\\ud83d", "\ufffd"),
    ("\\ud83d\\n", "\ufffd\n"), ("\\ude00", "\ufffd"), ("\\uZZZZ x", " x")])
def test_a_lone_or_broken_escape_in_words_neither_fails_nor_eats_what_follows(escaped, said):
    """A high surrogate's escape once took the next six characters as its pair's, closing quote
    and all; a \\u of no hex digits raised ValueError (a 500). A lone half is U+FFFD: a
    stream's UTF-8 cannot hold it."""
    text = (f'{{"name":"no_tool","arguments":{{"content":"a {escaped}"}}}}'
            '{"name":"t","arguments":{}}')
    expected = (f"a {said}", [("t", "{}")])
    for i in range(len(text) + 1):
        assert _split(lambda: JsonCalls(no_tool="no_tool"), text, i) == expected, i


def test_an_answer_in_words_cut_short_gives_the_words_so_far():
    """tool_choice=auto cut by max_tokens: never the wrapper's JSON."""
    text = '{"name":"no_tool","arguments":{"content":"The weather in Par'
    assert _whole(lambda: JsonCalls(no_tool="no_tool"), text) == ("The weather in Par", [])
    cut_call = '{"name":"get_weather","arguments":{"city":"Pa'
    assert _whole(lambda: JsonCalls(no_tool="no_tool"), cut_call) == (
        "", [("get_weather", '{"city":"Pa')])


def test_unknown_parsers_and_auto_without_a_parser_are_refused_at_start():
    for name in PARSERS:
        check_tool_parser(name, True)
    with pytest.raises(ValueError, match="'granite' is not one of hermes, llama3_json"):
        check_tool_parser("granite", False)
    with pytest.raises(ValueError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        check_tool_parser(None, True)


def test_only_a_parser_that_reads_a_special_token_keeps_them_in_the_text():
    from router.inputs.tool_plan import tool_plan

    tools = [{"type": "function", "function": {"name": "f"}}]
    for name in PARSERS:
        plan = tool_plan({"tools": tools}, parser=name, auto_parses=True)
        assert plan.skips_special_tokens == (name != "mistral"), name
        # required uses the grammar, whose JSON has no special token to read
        assert tool_plan({"tools": tools, "tool_choice": "required"}, parser=name,
                         auto_parses=True).skips_special_tokens
