"""Grammar-constrained generation in the engine: outputs follow the grammar, greedy or sampled."""
import json
import re

import jsonschema
import pytest

from tests.engine_helpers import BlockPool, make_engine, request, run_to_completion


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return make_engine(tiny_llama)


def _generate(engine, kind, value, *, do_sample, count=3, max_new_tokens=60):
    pool = BlockPool(512)
    prompt = engine.tokenizer.encode("Answer:").ids
    requests = []
    for i in range(count):
        r = request(i, prompt, pool.take(len(prompt) + max_new_tokens, 4),
                    max_new_tokens=max_new_tokens, do_sample=do_sample, seed=i, temperature=1.0)
        r.grammar = (kind, value)
        requests.append(r)
    # an unconstrained neighbour shares the batch
    requests.append(request(99, prompt, pool.take(len(prompt) + 20, 4), max_new_tokens=20))
    tokens = run_to_completion(engine, requests)
    return [engine.tokenizer.decode(tokens[i]) for i in range(count)], tokens[99]


@pytest.mark.parametrize("do_sample", [False, True])
def test_regex_outputs_match(engine, do_sample):
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    texts, _ = _generate(engine, "regex", pattern, do_sample=do_sample)
    assert all(re.fullmatch(pattern, t) for t in texts), texts


@pytest.mark.parametrize("do_sample", [False, True])
def test_json_schema_outputs_validate(engine, do_sample):
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
        "required": ["name", "age", "tags"], "additionalProperties": False}
    texts, _ = _generate(engine, "json", json.dumps(schema), do_sample=do_sample, max_new_tokens=80)
    for text in texts:
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("do_sample", [False, True])
def test_ebnf_outputs_follow_the_grammar(engine, do_sample):
    # GBNF, as SGLang's `ebnf` and llama.cpp write it
    grammar = 'root ::= answer " " number\nanswer ::= "yes" | "no"\nnumber ::= [1-9] [0-9]?'
    texts, _ = _generate(engine, "ebnf", grammar, do_sample=do_sample, max_new_tokens=20)
    assert all(re.fullmatch(r"(yes|no) [1-9][0-9]?", t) for t in texts), texts


def test_unconstrained_neighbour_is_unaffected(engine):
    _, with_neighbours = _generate(engine, "regex", "[a-z]+", do_sample=False)
    pool = BlockPool(512)
    prompt = engine.tokenizer.encode("Answer:").ids
    alone = run_to_completion(engine, [request(99, prompt, pool.take(len(prompt) + 20, 4),
                                               max_new_tokens=20)])
    assert with_neighbours == alone[99]


def test_every_grammar_type_of_the_contract_reaches_the_engine():
    from proto import generate_pb2 as pb
    from shard.convert import _GRAMMAR_KINDS
    assert set(_GRAMMAR_KINDS) == set(pb.GrammarType.values()) - {pb.GRAMMAR_TYPE_NONE}


def test_a_grammar_type_this_shard_does_not_know_refuses_that_request_alone():
    from proto import generate_pb2 as pb
    from shard.convert import new_request

    message = pb.Request(id=3, input_ids=[1], parameters=pb.NextTokenChooserParameters(
        grammar_type=7, grammar="x"), stopping_parameters=pb.StoppingCriteriaParameters(
        max_new_tokens=1))
    with pytest.raises(ValueError, match="grammar type 7 is not known"):
        new_request(message, hidden_size=8)
