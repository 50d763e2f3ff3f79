"""--reasoning-parser: the think rule on whole outputs and on streams cut at every point, and the
chat route's message.reasoning_content / delta.reasoning_content over a shard whose text is
scripted."""
import json

import pytest

from launcher.config import parse_args as launcher_args
from router.config.model import ModelSettings
from router.inputs.reasoning import (CLOSE, PARSERS, ThinkSplitter, check_parser, split_reasoning,
                                     starts_in_reasoning)
from tests.unit.router.test_api_errors import HealthyFake, _client


@pytest.mark.parametrize("text,in_reasoning,expected", [
    ("<think>\nplan\n</think>\n\nanswer", True, ("\nplan\n", "\n\nanswer")),  # Qwen3's own tags
    ("plan</think>answer", True, ("plan", "answer")),  # R1: the template opened the block
    ("plan, cut by max_tokens", True, ("plan, cut by max_tokens", None)),
    ("</think>answer", True, (None, "answer")),
    ("plan</think>", True, ("plan", None)),
    ("<think>a<think>b</think>c</think>d", True, ("a<think>b", "c</think>d")),  # one of each
    ("x<think>y</think>z", True, ("xy", "z")),
    ("<thin and </thinking> are text", True, ("<thin and </thinking> are text", None)),
    ("a</think>b", False, (None, "a</think>b")),  # the prompt closed the block: all answer
    ("", True, (None, None)),
])
def test_whole_outputs_split_as_vllms_deepseek_r1_parser(text, in_reasoning, expected):
    assert split_reasoning(text, in_reasoning) == expected


SAMPLES = ["<think>\nI add 2 and 2.\n</think>\n\nIt is 4.", "R1 plans</think>and answers",
           "<think>a <thi b </th c</think>d </think> e", "<<think><</think></", "no tags at all <"]


def _streamed(pieces: list[str], in_reasoning: bool = True) -> tuple[str, str]:
    splitter = ThinkSplitter(in_reasoning)
    thought, answer = "", ""
    for piece in pieces:
        more_thought, more_answer = splitter.feed(piece)
        assert len(splitter.pending) < len(CLOSE), "holds back no more than a tag's beginning"
        thought, answer = thought + more_thought, answer + more_answer
    rest_thought, rest_answer = splitter.finish()
    return thought + rest_thought, answer + rest_answer


@pytest.mark.parametrize("text", SAMPLES)
def test_a_stream_cut_anywhere_splits_as_the_whole_output(text):
    whole = tuple(part or "" for part in split_reasoning(text))
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            assert _streamed([text[:i], text[i:j], text[j:]]) == whole, (i, j)
    assert _streamed(list(text)) == whole  # a character a token


def test_a_stream_sends_the_reasoning_as_it_comes_and_holds_only_a_possible_tag():
    splitter = ThinkSplitter()
    assert splitter.feed("<th") == ("", "")
    assert splitter.feed("ink>step one </") == ("step one ", "")
    assert splitter.feed("th") == ("", "")
    assert splitter.feed("ing") == ("</thing", "")  # not the tag after all: reasoning text
    assert splitter.feed(" two</thi") == (" two", "")
    assert splitter.feed("nk>Fi") == ("", "Fi")
    assert splitter.feed("ne <think>") == ("", "ne <think>")  # the answer is never held
    assert splitter.finish() == ("", "")


def test_the_prompts_last_think_tag_says_where_the_output_begins():
    assert starts_in_reasoning("<|im_start|>assistant\n")  # no tag: the model may think
    assert starts_in_reasoning("<｜Assistant｜><think>\n")  # R1's template opens the block
    assert not starts_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # Qwen3, off
    assert starts_in_reasoning("earlier <think>x</think> turn, then <think>\n")
    # a user quoting the closing tag does not switch thinking off: only the prompt's end counts
    assert starts_in_reasoning("<|im_start|>user\nWhat does </think> mean?<|im_end|>\n"
                               "<|im_start|>assistant\n")


def test_unknown_parser_names_are_refused_at_start_with_the_list():
    for name in PARSERS:
        check_parser(name)
        assert ModelSettings(tokenizer_path="x", reasoning_parser=name).reasoning_parser == name
    with pytest.raises(ValueError, match="'granite' is not one of think, deepseek_r1, qwen3"):
        ModelSettings(tokenizer_path="x", reasoning_parser="granite")
    # the launcher takes the flag and hands it to the router
    argv = launcher_args(["--reasoning-parser", "qwen3"]).router_argv(tokenizer_path="m",
                                                                       model_id="m")
    assert argv[argv.index("--reasoning-parser") + 1] == "qwen3"


class ScriptedText(HealthyFake):
    """The scripted shard with the texts of its tokens given: token i's text is pieces[i - 1]."""

    def __init__(self, pieces: list[str]):
        super().__init__()
        self.pieces = pieces

    def _step(self, request_ids, tokens=1):
        generations = super()._step(request_ids, tokens)
        for generation in generations:
            for event in generation.events:
                event.token.text = self.pieces[event.token.id - 1]
                if event.final is not None:
                    event.final.text = "".join(self.pieces[:event.final.generated_tokens])
        return generations


PIECES = ["<th", "ink>\nLet me", " add.</", "think>", "\n\nIt is", " 4."]
ASK = [{"role": "user", "content": "2+2?"}]


def _chunks(raw: str) -> list[dict]:
    chunks = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    return [chunk for chunk in chunks if chunk["choices"]]


async def test_a_chat_answer_splits_whole_and_streamed_for_every_choice(tiny_llama):
    client = await _client(tiny_llama, ScriptedText(PIECES), reasoning_parser="think")
    body = {"messages": ASK, "max_tokens": len(PIECES), "n": 2, "logprobs": True}
    try:
        answer = await (await client.post("/v1/chat/completions", json=body)).json()
        for choice in answer["choices"]:
            assert choice["message"] == {"role": "assistant", "content": "\n\nIt is 4.",
                                         "reasoning_content": "\nLet me add."}
            assert len(choice["logprobs"]["content"]) == len(PIECES)
        reply = await client.post("/v1/chat/completions", json={**body, "stream": True})
        chunks = _chunks(await reply.text())
        for index in (0, 1):
            deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"][0]["index"] == index]
            assert len(deltas) == len(PIECES), "a chunk per token, with its logprobs"
            thought = [d.get("reasoning_content", "") for d in deltas]
            said = [d["content"] for d in deltas]
            assert "".join(thought) == "\nLet me add." and "".join(said) == "\n\nIt is 4."
            last_thought = max(i for i, t in enumerate(thought) if t)
            assert not any(said[:last_thought + 1]), "the reasoning comes before the answer"
    finally:
        await client.close()


async def test_an_answer_cut_while_thinking_has_no_content(tiny_llama):
    client = await _client(tiny_llama, ScriptedText(PIECES), reasoning_parser="deepseek_r1")
    try:
        answer = await (await client.post("/v1/chat/completions",
                                          json={"messages": ASK, "max_tokens": 3})).json()
        message = answer["choices"][0]["message"]
        assert message["content"] is None and message["reasoning_content"] == "\nLet me add.</"
    finally:
        await client.close()


async def test_without_the_flag_or_with_a_grammar_the_text_stays_whole(tiny_llama):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    plain = await _client(tiny_llama, ScriptedText(PIECES))
    shaped = await _client(tiny_llama, ScriptedText(PIECES), reasoning_parser="think",
                           max_total_tokens=1024)  # the tools' prompt
    try:
        body = {"messages": ASK, "max_tokens": len(PIECES)}
        message = (await (await plain.post("/v1/chat/completions", json=body)).json()
                   )["choices"][0]["message"]
        assert message == {"role": "assistant", "content": "".join(PIECES)}
        # a forced tool call is JSON from its first token: nothing in it is reasoning (the
        # scripted text is no JSON, so no call and no words are read from it)
        message = (await (await shaped.post("/v1/chat/completions", json={
            **body, "tools": [tool], "tool_choice": "required"})).json())["choices"][0]["message"]
        assert message == {"role": "assistant", "content": ""}
    finally:
        await plain.close()
        await shaped.close()
