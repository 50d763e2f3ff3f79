"""A call's next plain step queued before the last one is read: the same tokens, never a slot past
what the router gave. On the CPU the queued forward computes at once; on CUDA (CUDA graphs) it
runs while the host reads the step before."""
import pytest
import torch

from shard.outputs import StepOutput
from shard.stopping import FinishReason
from tests.engine_helpers import BlockPool, make_engine
from tests.engine_helpers import request as new_request

TEXTS = ["The quick brown fox", "Paris is the capital of", "Once upon a time there was a small",
         "def add(a, b):"]
# greedy; seeded sampling with top tokens; a repetition penalty; greedy, the longest
PARAMS = [{}, {"do_sample": True, "seed": 7, "temperature": 0.8, "top_n_tokens": 2},
          {"repetition_penalty": 1.3}, {}]
MAX_NEW = [6, 11, 9, 14]


@pytest.fixture(scope="module", params=["cpu", "cuda"])
def engine(tiny_llama, request):
    if request.param == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device")
        return make_engine(tiny_llama, num_blocks=128, device="cuda", cuda_graphs="auto",
                           max_total_tokens=64)
    return make_engine(tiny_llama, num_blocks=128)


def _run(engine, *, run_ahead: bool, max_steps: int, stop: dict[int, str] | None = None,
         join: bool = False):
    """Every request's (token, log-prob, text) and finish, the steps taken and the forwards run.

    Each request is given exactly the slots the router gives (input + max_new_tokens - 1), and
    the batch is driven as the router drives it: calls of up to max_steps steps, finished
    requests filtered between them; `join`: after the first call, the last request's prompt is
    prefilled in two chunks, each carrying the running batch's next step (a long prompt that
    arrived meanwhile)."""
    engine.run_ahead = run_ahead
    forwards = [0]  # forwards computing the running batch's step: decode ones, riding prefills
    decode, prefill = engine.runner.decode, engine.runner.prefill

    def counted(*args, **kwargs):
        forwards[0] += 1
        return decode(*args, **kwargs)

    def riding(*args, **kwargs):
        forwards[0] += kwargs.get("decode") is not None
        return prefill(*args, **kwargs)

    engine.runner.decode, engine.runner.prefill = counted, riding
    pool = BlockPool(128)
    requests = []
    for i, (text, params, max_new) in enumerate(zip(TEXTS, PARAMS, MAX_NEW)):
        prompt = engine.tokenizer.encode(text).ids
        extra = {"stop_sequences": [stop[i]]} if stop and i in stop else {}
        requests.append(new_request(i + 1, prompt, pool.take(len(prompt) + max_new - 1, 4),
                                max_new_tokens=max_new, ignore_eos=True, **extra, **params))
    got = {r.id: [] for r in requests}
    finish, steps, calls = {}, 0, 0
    # the joiner's prompt in two chunks, after the first call and after the second, each
    # carrying the running batch's next step: after the first, the batch holds the same
    # requests as before, and a decode call comes between the two
    parts = []
    if join:
        joiner = requests.pop()
        half = len(joiner.input_ids) // 2
        first = new_request(joiner.id, joiner.input_ids, joiner.blocks,
                            max_new_tokens=joiner.max_new_tokens, ignore_eos=True)
        first.cache_len, first.chunk_len = 0, half
        joiner.cache_len = half
        parts = [first, joiner]
    out = engine.prefill(1, requests)
    try:
        while True:
            for g in out.generations:
                got[g.request_id] += _tokens(g)
                if g.generated_text is not None:
                    finish[g.request_id] = g.generated_text.finish_reason
            if out.batch is None:
                break
            alive = [r for r in out.batch.request_ids if r not in finish]
            if len(alive) < len(out.batch.request_ids):
                engine.filter(out.batch.id, alive)
            if parts and calls == 3 - len(parts):
                out = engine.prefill(2, [parts.pop(0)], cached_batch_id=out.batch.id)
                continue
            out = engine.decode([out.batch.id], max_steps)
            steps, calls = steps + out.steps, calls + 1
    finally:
        engine.runner.decode, engine.runner.prefill = decode, prefill
        engine.run_ahead = engine.runner.device.type == "cuda"
    return got, finish, steps, forwards[0]


def _tokens(generation) -> list[tuple]:
    """A generation's tokens: id, log-probability, text and top tokens each."""
    tops = [tuple(t.ids) for t in generation.top_tokens] or [()] * len(generation.tokens.ids)
    return list(zip(generation.tokens.ids, generation.tokens.logprobs, generation.tokens.texts,
                    tops))


def _a_stop_mid_call(tokens: dict[int, list]) -> tuple[int, int, str]:
    """(request index, token index, text) of a token whose text first appears there, after the
    first few tokens: a stop sequence that ends that request inside a call."""
    for rid, run in tokens.items():
        for k in range(3, len(run) - 2):
            piece = run[k][2].strip()
            earlier = "".join(t[2] for t in run[:k])
            if len(piece) > 1 and piece not in earlier:
                return rid - 1, k, piece
    raise AssertionError("no token of the reference run can serve as a stop sequence")


def test_steps_run_ahead_give_the_tokens_of_steps_run_one_by_one(engine):
    one_by_one, finish, steps, forwards = _run(engine, run_ahead=False, max_steps=1)
    assert forwards == steps
    assert [len(t) for t in one_by_one.values()] == MAX_NEW
    assert set(finish.values()) == {FinishReason.LENGTH}
    ahead, ahead_finish, ahead_steps, ahead_forwards = _run(engine, run_ahead=True, max_steps=5)
    assert ahead == one_by_one and ahead_finish == finish and ahead_steps == steps
    # no step is queued past a request's last token, and a call's last step queues the next
    # call's first: no forward was computed for nothing
    assert ahead_forwards == steps


def test_a_request_that_stops_inside_a_call_drops_the_step_queued_after(engine):
    reference, _, _, _ = _run(engine, run_ahead=False, max_steps=1)
    index, k, piece = _a_stop_mid_call(reference)
    stop = {index: piece}
    one_by_one, finish, steps, forwards = _run(engine, run_ahead=False, max_steps=1, stop=stop)
    assert finish[index + 1] == FinishReason.STOP_SEQUENCE and len(one_by_one[index + 1]) == k + 1
    ahead, ahead_finish, ahead_steps, ahead_forwards = _run(engine, run_ahead=True, max_steps=8,
                                                            stop=stop)
    assert ahead == one_by_one and ahead_finish == finish and ahead_steps == steps
    # the step queued behind the stop is the kept requests' next one, once the batch is filtered
    assert ahead_forwards == steps


def test_a_prefill_carrying_the_batch_takes_the_step_queued_for_it(engine):
    """The running batch's step comes from the step queued before the chunk's forward, not from
    rows riding in it: the same tokens, log-probabilities within the rounding of a forward of
    other rows."""
    plain, finish, steps, forwards = _run(engine, run_ahead=False, max_steps=4, join=True)
    assert len(plain[len(TEXTS)]) == MAX_NEW[-1] and forwards == steps + 2  # 2 chunks ride
    ahead, ahead_finish, ahead_steps, ahead_forwards = _run(engine, run_ahead=True, max_steps=4,
                                                            join=True)
    assert ahead_finish == finish and ahead_steps == steps
    for rid, tokens in plain.items():
        assert [(i, text, top) for i, _, text, top in ahead[rid]] == [
            (i, text, top) for i, _, text, top in tokens]
        assert [lp for _, lp, _, _ in ahead[rid]] == pytest.approx(
            [lp for _, lp, _, _ in tokens], rel=1e-5)
    # each chunk after a call took the step that call queued, or rode: none computed twice
    assert ahead_forwards == forwards


def _two_batches(engine, run_ahead: bool) -> tuple[dict[int, list], int]:
    """A router that prefills a new batch alone and then decodes both batches merged: each
    request's tokens and the forwards that computed a decode step (run_ahead as given)."""
    engine.run_ahead = run_ahead
    forwards, decode = [0], engine.runner.decode

    def counted(*args, **kwargs):
        forwards[0] += 1
        return decode(*args, **kwargs)

    engine.runner.decode = counted
    pool = BlockPool(128)
    prompts = [engine.tokenizer.encode(t).ids for t in TEXTS]
    made = [new_request(10 + i, p, pool.take(len(p) + 11, 4), max_new_tokens=12,
                        ignore_eos=True) for i, p in enumerate(prompts)]
    got = {r.id: [] for r in made}

    def record(out):
        """Each generation's tokens; the finished requests filtered out, as the router does."""
        for g in out.generations:
            got[g.request_id] += _tokens(g)
        done = {g.request_id for g in out.generations if g.generated_text is not None}
        if out.batch is not None and done:
            alive = [r for r in out.batch.request_ids if r not in done]
            if not alive:
                engine.clear(out.batch.id)
                return StepOutput([], None)
            engine.filter(out.batch.id, alive)
        return out

    try:
        running = record(engine.prefill(1, made[:2]))
        record(engine.decode([running.batch.id], 3))  # queues the running batch's next step
        new = record(engine.prefill(2, made[2:]))  # alone: the queued step stays
        record(engine.decode([1], 3))  # takes it, queues the next
        out = record(engine.decode([1, new.batch.id], 3))  # merged: the queued step is not its
        while out.batch is not None:
            out = record(engine.decode([out.batch.id], 3))
    finally:
        engine.runner.decode = decode
        engine.run_ahead = engine.runner.device.type == "cuda"
    return got, forwards[0]


def test_a_step_queued_for_a_batch_is_kept_beside_another_and_not_taken_by_their_merge(engine):
    plain, forwards = _two_batches(engine, run_ahead=False)
    assert all(len(tokens) == 12 for tokens in plain.values())
    ahead, ahead_forwards = _two_batches(engine, run_ahead=True)
    assert ahead == plain
    assert ahead_forwards == forwards + 1, "only the step queued before the merge is dropped"
