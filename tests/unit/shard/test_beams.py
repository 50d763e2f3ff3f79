"""Beam search inside the engine's batches equals transformers' beam search, and the beams' KV
blocks are shared and copied on write within the blocks the request holds."""
import pytest
import torch

from shard.beams import BeamBlocks
from tests.engine_helpers import (BlockPool, make_engine, request, run_to_completion,
                                  steps_to_completion)

PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [11, 12], [200, 201, 202, 203, 204, 205, 206, 207, 208]]


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return make_engine(tiny_llama, num_blocks=1024)


@pytest.fixture(scope="module")
def reference(tiny_llama):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama,
                                                             dtype=torch.float32).eval()


def _beam_request(rid, prompt, pool, num_beams, length_penalty, max_new_tokens):
    per_beam = -(-(len(prompt) + max_new_tokens - 1) // 4)
    r = request(rid, prompt, pool.take((num_beams * per_beam + 1) * 4, 4),
                max_new_tokens=max_new_tokens)
    r.num_beams, r.length_penalty = num_beams, length_penalty
    return r


def _expected(reference, engine, prompt, num_beams, length_penalty, max_new_tokens):
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt]), num_beams=num_beams,
                                 length_penalty=length_penalty, do_sample=False,
                                 max_new_tokens=max_new_tokens, pad_token_id=0,
                                 eos_token_id=sorted(engine.loaded.eos_token_ids))
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("num_beams,length_penalty", [(2, 1.0), (4, 1.0), (4, 0.0), (3, 2.5)])
def test_beams_equal_transformers_beside_greedy_requests(engine, reference, num_beams,
                                                         length_penalty):
    pool = BlockPool(1024)
    beams = [_beam_request(i, p, pool, num_beams, length_penalty, 10)
             for i, p in enumerate(PROMPTS)]
    greedy = request(99, PROMPTS[0], pool.take(len(PROMPTS[0]) + 12, 4), max_new_tokens=12,
                     ignore_eos=True)
    finals, greedy_tokens = {}, []
    for out in steps_to_completion(engine, beams + [greedy]):
        for g in out.generations:
            if g.request_id == 99:
                greedy_tokens += g.tokens.ids
            if g.generated_text is not None:
                finals[g.request_id] = g.generated_text
    for i, prompt in enumerate(PROMPTS):
        expected = _expected(reference, engine, prompt, num_beams, length_penalty, 10)
        assert finals[i].token_ids == expected, (i, finals[i].token_ids, expected)
        assert finals[i].text == engine.tokenizer.decode(expected, skip_special_tokens=True)
    alone = run_to_completion(engine, [request(7, PROMPTS[0], pool.take(40, 4),
                                               max_new_tokens=12, ignore_eos=True)])
    assert greedy_tokens == alone[7], "a greedy request is unaffected by the beams beside it"


def test_blocks_are_shared_by_reference_and_copied_only_when_written():
    blocks = BeamBlocks([1, 2], spare=[10, 11, 12, 13, 14, 15, 16], block_size=4)  # prompt of 6
    blocks.reorder([0, 0, 0])  # three beams from the one prompt
    assert blocks.tables == [[1, 2]] * 3
    copies = blocks.prepare_writes(6)  # position 6 is in the prompt's block 2: never in place
    assert copies == [(2, 10), (2, 11), (2, 12)] and [t[1] for t in blocks.tables] == [10, 11, 12]
    assert blocks.prepare_writes(7) == []  # each beam owns its block now
    blocks.reorder([1, 1, 2])  # beam 0 dies: its block goes back to the spare ones
    assert 10 in blocks.free and blocks.refs[11] == 2 and 2 not in blocks.free
    copies = blocks.prepare_writes(7)  # the two beams from beam 1 share block 11: one copies
    assert copies == [(11, 10)] and blocks.refs[11] == 1
    copies = blocks.prepare_writes(8)  # a new block for each (position 8 starts block 2)
    assert copies == [] and all(len(t) == 3 for t in blocks.tables)
    assert len({t[2] for t in blocks.tables}) == 3
    blocks.reorder([0, 0, 0])
    assert {1, 2}.isdisjoint(blocks.free), "the prompt's blocks are never handed out again"


def test_beam_sampling_keeps_a_way_on_and_survives_extreme_settings():
    from shard.beams import BeamOptions, BeamSearch

    generator = torch.Generator().manual_seed(3)
    logprobs = torch.log_softmax(torch.randn(1, 50), dim=-1)
    # top_k 1 still keeps 1 + (EOS ids) tokens, as transformers does with beams
    search = BeamSearch(BeamOptions(2, do_sample=True, top_k=1), [7], 5, generator)
    search.step(logprobs)
    assert torch.isfinite(search.scores).all()
    cold = BeamSearch(BeamOptions(2, do_sample=True, temperature=1e-45), [7], 5, generator)
    cold.step(logprobs)
    cold.step(torch.log_softmax(torch.randn(2, 50), dim=-1))
    assert len(cold.running) == 2 and not any(t is None for t in cold.next_tokens())
    long = BeamSearch(BeamOptions(2, length_penalty=10.0), [7], 4096, None)
    for _ in range(3):
        long.step(torch.log_softmax(torch.randn(long.width, 50), dim=-1))
    assert long.width == 2


def test_a_search_failing_at_its_first_step_ends_its_request_alone(engine, monkeypatch):
    from shard.beams import BeamSearch

    def broken(self, logprobs):
        raise RuntimeError("injected")

    monkeypatch.setattr(BeamSearch, "step", broken)
    pool = BlockPool(1024)
    beam = _beam_request(0, PROMPTS[0], pool, 2, 1.0, 6)
    greedy = request(99, PROMPTS[1], pool.take(20, 4), max_new_tokens=6, ignore_eos=True)
    out = engine.prefill(1, [beam, greedy])
    ended = {g.request_id: g.generated_text for g in out.generations if g.generated_text}
    assert ended[0].generated_tokens == 1 and len(ended[0].token_ids) == 1
    assert out.batch is not None and 99 in out.batch.request_ids
    engine.clear(out.batch.id)
