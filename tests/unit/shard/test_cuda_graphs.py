"""Decode steps replayed from captured graphs give the eager steps' tokens.

On the CPU the capture is emulated with the contract a CUDA graph imposes: a replay recomputes
the step from whatever its input buffers hold at that moment and writes the results into the same
output tensors it returned at capture. A runner that forgot to copy a batch in, left a previous
batch's rows in the padding, or handed out a buffer the next replay overwrites fails here as it
would on a GPU. The last test runs the real capture where CUDA is present.
"""
import pytest
import torch

from shard.config import AUTO_CUDA_GRAPHS, parse_cuda_graphs
from shard.decode_paths.cuda_graphs import (GraphedDecode, auto_batch_sizes, largest_decode_batch,
                                            width_buckets)
from tests.engine_helpers import (BlockPool, make_engine, request, run_to_completion,
                                  steps_to_completion)


class EmulatedCapture:
    """Captures by running the step once on its buffers; replays rerun it on them, in place.
    Called with a device it stands for a new capture (GraphedDecode's `new_capture`)."""

    def __init__(self, fail_at: tuple[int, int] | None = None):
        self.captured: list[tuple[int, int]] = []  # (rows, width) per capture
        self.replays = 0
        self.fail_at = fail_at

    def __call__(self, *args):
        if len(args) == 1:  # a device: a new capture begins
            return self
        step, inputs = args
        bucket = (inputs[0].shape[0], inputs[2].shape[1])
        if bucket == self.fail_at:
            raise RuntimeError("out of memory while capturing")
        self.captured.append(bucket)
        outputs = step(*inputs)

        def replay():
            self.replays += 1
            for buffer, value in zip(outputs, step(*inputs)):
                buffer.copy_(value)
        return outputs, replay


class TracedCapture(EmulatedCapture):
    """Captures by tracing the step whole (torch.compile, fullgraph): a step that reads a value
    back to the host (.item(), .tolist()) or branches on one breaks the trace and fails the
    capture, as it would fail a CUDA graph's. Replays run the traced step."""

    def __call__(self, *args):
        if len(args) == 1:
            return self
        step, inputs = args
        traced = torch.compile(step, fullgraph=True, backend="eager", dynamic=False)
        outputs = traced(*inputs)
        self.captured.append((inputs[0].shape[0], inputs[2].shape[1]))

        def replay():
            self.replays += 1
            for buffer, value in zip(outputs, traced(*inputs)):
                buffer.copy_(value)
        return outputs, replay


def _prompts(engine, count):
    texts = ["The quick brown fox", "Once upon a time there was a", "café au lait", "x",
             "a b c d e f g h i j k l m n o p", "Hello", "1 2 3"]
    return [engine.tokenizer.encode(texts[i % len(texts)]).ids for i in range(count)]


def _greedy(engine, count, new_tokens=12, batched=True):
    pool = BlockPool(512)
    requests = [request(i, p, pool.take(len(p) + new_tokens, 4), max_new_tokens=new_tokens,
                        ignore_eos=True)
                for i, p in enumerate(_prompts(engine, count))]
    if batched:
        return run_to_completion(engine, requests)
    out = {}
    for r in requests:
        out.update(run_to_completion(engine, [r], batch_id=10 + r.id))
    return out


@pytest.mark.parametrize("speculate", [0, 3])
def test_graphed_steps_give_the_eager_steps_tokens(tiny_llama, speculate):
    eager = make_engine(tiny_llama, speculate=speculate)
    capture = EmulatedCapture()
    graphed = make_engine(tiny_llama, cuda_graphs=[1, 2, 4, 16], new_capture=capture,
                          max_total_tokens=64, speculate=speculate)
    # widths in 4-token blocks up to 64 tokens: 1, 2, 4, 8, 16 blocks, for each batch size
    assert sorted(capture.captured) == sorted((b, w) for b in (1, 2, 4, 16)
                                              for w in (1, 2, 4, 8, 16))
    for count, batched in ((1, False), (3, True), (4, True)):
        before = capture.replays
        assert _greedy(graphed, count, batched=batched) == _greedy(eager, count, batched=batched)
        # every decode step replayed a graph (the first token of each request is its prefill's);
        # speculating, a step verifies drafts in more rows and takes several tokens
        if speculate:
            assert capture.replays > before
        elif batched:
            assert capture.replays - before == 11
        else:
            assert capture.replays - before == count * 11


def test_the_captured_step_reads_nothing_back_to_the_host(tiny_llama):
    torch._dynamo.reset()
    capture = TracedCapture()
    with torch._dynamo.config.patch(recompile_limit=64):  # a trace per bucket
        graphed = make_engine(tiny_llama, cuda_graphs=[4], new_capture=capture,
                              max_total_tokens=64)
        assert sorted(capture.captured) == [(4, w) for w in (1, 2, 4, 8, 16)]
        eager = make_engine(tiny_llama)
        assert _greedy(graphed, 3) == _greedy(eager, 3)
        assert capture.replays > 0


def _tokens_and_finals(engine, max_steps, with_beam=True):
    """Two greedy requests and (with_beam) a 3-beam search decoded with calls of up to max_steps
    steps, finished requests filtered between calls as the router does."""
    pool = BlockPool(512)
    prompts = _prompts(engine, 3)
    requests = [request(i, p, pool.take(len(p) + 10, 4), max_new_tokens=n, ignore_eos=True)
                for i, (p, n) in enumerate(zip(prompts[:2], (6, 10)))]
    beam = request(2, prompts[2], pool.take(3 * (len(prompts[2]) + 8) + 8, 4), max_new_tokens=8)
    beam.num_beams = 3
    requests += [beam] if with_beam else []
    out = engine.prefill(1, requests)
    tokens, finals = {r.id: [] for r in requests}, {}
    while True:
        for g in out.generations:
            tokens[g.request_id] += g.tokens.ids
            if g.generated_text is not None:
                finals[g.request_id] = g.generated_text.token_ids
        if out.batch is None:
            return tokens, finals
        alive = [r for r in out.batch.request_ids if r not in finals]
        if not alive:
            engine.clear(out.batch.id)
            return tokens, finals
        if len(alive) < len(out.batch.request_ids):
            engine.filter(out.batch.id, alive)
        out = engine.decode([out.batch.id], max_steps)


def test_beams_and_several_steps_a_call_replay_as_eager_steps(tiny_llama):
    eager = make_engine(tiny_llama)
    capture = EmulatedCapture()
    graphed = make_engine(tiny_llama, cuda_graphs=[1, 2, 4, 8], new_capture=capture,
                          max_total_tokens=64)
    want = _tokens_and_finals(eager, 1)
    assert _tokens_and_finals(graphed, 1) == want
    # without the beam search in the batch, calls of several steps (a step a replay)
    before = capture.replays
    want = _tokens_and_finals(eager, 1, with_beam=False)
    assert _tokens_and_finals(graphed, 4, with_beam=False) == want
    assert capture.replays - before == 9  # 10 tokens, the first from the prefill


def test_steps_no_graph_holds_run_eagerly(tiny_llama):
    eager = make_engine(tiny_llama)
    capture = EmulatedCapture()
    graphed = make_engine(tiny_llama, cuda_graphs=[1, 2], new_capture=capture, max_total_tokens=16)
    # 6 rows: past the largest batch size; 30 new tokens: contexts past the 16-token widths, so
    # after a few steps the single row runs eagerly too
    assert _greedy(graphed, 6) == _greedy(eager, 6)
    assert capture.replays == 0
    before = capture.replays
    assert _greedy(graphed, 1, new_tokens=30) == _greedy(eager, 1, new_tokens=30)
    assert 0 < capture.replays - before < 29


def test_padding_rows_are_reset_and_results_are_copies():
    calls = []

    def step(ids, lens, tables, positions):
        assert torch.equal(positions, lens)  # rotated at seq_lens, padding rows included
        calls.append((ids.clone(), lens.clone(), tables.clone()))
        logits = (ids * 100 + lens).float().unsqueeze(1) + tables.sum(1, keepdim=True)
        return logits, logits * 2

    graphs = GraphedDecode(step, [4], torch.device("cpu"), block_bytes=1,
                           new_capture=EmulatedCapture())
    graphs.capture(max_width=3)
    assert graphs.widths == [1, 2, 3]
    first, _ = graphs(torch.tensor([1, 2, 3]), torch.tensor([5, 6, 7]),
                      torch.tensor([[1, 2], [3, 4], [5, 6]]), width=2)
    assert first.flatten().tolist() == [108.0, 213.0, 318.0]
    second, hidden = graphs(torch.tensor([9]), torch.tensor([4]), torch.tensor([[7, 8, 9]]),
                            width=1)
    ids, lens, tables = calls[-1]
    # the one-row step replayed the 4-row, 1-column graph: rows 1-3 are padding again
    assert ids.tolist() == [9, 0, 0, 0] and lens.tolist() == [4, 0, 0, 0]
    assert tables.tolist() == [[7], [0], [0], [0]]
    assert second.flatten().tolist() == [911.0] and hidden.flatten().tolist() == [1822.0]
    assert first.flatten().tolist() == [108.0, 213.0, 318.0], "a replay overwrote a result"
    # wider tables than captured, or more rows: no graph
    assert graphs(torch.tensor([1]), torch.tensor([40]), torch.zeros(1, 4, dtype=torch.long),
                  width=4) is None
    assert graphs.bucket(5, 1) is None


def test_a_new_pool_drops_the_graphs_until_captured_again(tiny_llama):
    capture = EmulatedCapture()
    engine = make_engine(tiny_llama, cuda_graphs=[2], new_capture=capture, max_total_tokens=8,
                         num_blocks=64)
    runner = engine.runner
    assert runner.graphs.captured and runner.graphs.widths == [1, 2]
    runner.allocate(32)
    assert not runner.graphs.captured, "graphs captured over the old pool must not replay"
    before = capture.replays
    _greedy(engine, 2, new_tokens=3)
    assert capture.replays == before
    runner.warm_decode(20)  # 5 blocks of 4 tokens
    assert runner.graphs.captured and runner.graphs.widths == [1, 2, 4, 5]


def test_without_a_longest_request_or_when_capture_fails_steps_run_eagerly(tiny_llama, caplog):
    eager = make_engine(tiny_llama)
    unknown = make_engine(tiny_llama, cuda_graphs=[2], new_capture=EmulatedCapture())
    assert not unknown.runner.graphs.captured
    assert "did not say how long a request may be" in caplog.text
    failing = EmulatedCapture(fail_at=(2, 2))
    broken = make_engine(tiny_llama, cuda_graphs=[1, 2], new_capture=failing,
                         max_total_tokens=16)
    assert not broken.runner.graphs.captured, "no graph kept from a capture that failed"
    assert "could not be captured in CUDA graphs, it runs eagerly" in caplog.text
    assert _greedy(broken, 2) == _greedy(eager, 2) and failing.replays == 0
    # tensor-parallel ranks must not go on with graphs some rank may not have
    broken.runner.world_size = 2
    with pytest.raises(RuntimeError, match="out of memory while capturing"):
        broken.runner.warm_decode(16)


def test_buckets_gathering_too_much_are_left_to_eager_steps(monkeypatch):
    from shard.decode_paths import cuda_graphs

    monkeypatch.setattr(cuda_graphs, "MAX_GATHER_BYTES", 64)
    capture = EmulatedCapture()
    graphs = GraphedDecode(lambda ids, lens, tables, at: (ids.float(), ids.float()), [1, 2, 4],
                           torch.device("cpu"), block_bytes=8, new_capture=capture)
    graphs.capture(max_width=8)
    # rows x width x 8 bytes <= 64
    assert sorted(capture.captured) == [(1, 1), (1, 2), (1, 4), (1, 8), (2, 1), (2, 2), (2, 4),
                                        (4, 1), (4, 2)]
    assert graphs.bucket(3, 3) is None and graphs.bucket(2, 3).block_tables.shape == (2, 4)
    assert graphs(torch.tensor([5, 6, 7]), torch.tensor([1, 1, 1]),
                  torch.zeros(3, 4, dtype=torch.long), width=4) is None


def test_a_step_gathering_nothing_is_captured_at_one_width_for_every_batch_size():
    """Triton's kernel reads each row's context in place (block_bytes 0): no width costs more."""
    capture = EmulatedCapture()
    graphs = GraphedDecode(lambda ids, lens, tables, positions: (ids.float(), ids.float()), [1, 2, 4],
                           torch.device("cpu"), block_bytes=0, new_capture=capture)
    graphs.capture(max_width=1 << 12)  # a 64k-token request of 16-token blocks
    assert sorted(capture.captured) == [(1, 4096), (2, 4096), (4, 4096)]
    logits, _ = graphs(torch.tensor([5, 6, 7]), torch.tensor([1, 1, 1]),
                       torch.zeros(3, 2, dtype=torch.long), width=2)
    assert logits.tolist() == [5.0, 6.0, 7.0]


def test_width_buckets():
    assert width_buckets(1) == [1]
    assert width_buckets(8) == [1, 2, 4, 8]
    assert width_buckets(9) == [1, 2, 4, 8, 9]


def test_parse_cuda_graphs():
    assert parse_cuda_graphs("1,2,4,8,16,32") == [1, 2, 4, 8, 16, 32]
    assert parse_cuda_graphs("auto") == AUTO_CUDA_GRAPHS
    assert parse_cuda_graphs("8, 2,2") == [2, 8]
    assert parse_cuda_graphs("0") == [] and parse_cuda_graphs("") == []
    with pytest.raises(ValueError, match="at least 1"):
        parse_cuda_graphs("0,4")
    with pytest.raises(ValueError, match="comma-separated"):
        parse_cuda_graphs("four")


def test_without_cuda_graphs_sizes_reach_the_largest_decode_batch():
    # --max-batch-size, else what the pool holds (a block a request, block 0 never handed out)
    assert largest_decode_batch(num_blocks=4000, max_batch_size=None) == 256
    assert largest_decode_batch(num_blocks=4000, max_batch_size=48) == 48
    assert largest_decode_batch(num_blocks=20, max_batch_size=64) == 19
    assert largest_decode_batch(num_blocks=4000, max_batch_size=1000) == 256
    # ranks size their own pools: the graphs of each must be the same, whatever its pool
    assert largest_decode_batch(num_blocks=20, max_batch_size=None, ranks=2) == 256
    assert largest_decode_batch(num_blocks=21, max_batch_size=64, ranks=2) == 64
    # attention in place: vLLM's spacing, past TGI's 32
    assert auto_batch_sizes(256, gathers=False) == [1, 2, 4, *range(8, 257, 8)]
    assert auto_batch_sizes(33, gathers=False) == [1, 2, 4, 8, 16, 24, 32, 33]
    assert auto_batch_sizes(3, gathers=False) == [1, 2, 3]
    # attention that gathers, captured at several widths too: powers of two
    assert auto_batch_sizes(256, gathers=True) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert auto_batch_sizes(40, gathers=True) == [1, 2, 4, 8, 16, 32, 40]


def test_auto_graphs_follow_the_warm_up_and_share_one_output_buffer(tiny_llama):
    capture = EmulatedCapture()
    graphed = make_engine(tiny_llama, cuda_graphs=AUTO_CUDA_GRAPHS, new_capture=capture,
                          num_blocks=40)
    runner = graphed.runner
    runner.warm_decode(64, max_batch_size=6)  # widths of 1 to 16 4-token blocks
    assert runner.graphs.batch_sizes == [1, 2, 4, 6]
    assert sorted(capture.captured) == [(b, w) for b in (1, 2, 4, 6) for w in (1, 2, 4, 8, 16)]
    # every graph writes its results into the largest one's buffers
    storages = {(g.logits.untyped_storage().data_ptr(), g.hidden.untyped_storage().data_ptr())
                for g in runner.graphs.graphs.values()}
    assert len(storages) == 1
    assert _greedy(graphed, 6, new_tokens=3) == _greedy(make_engine(tiny_llama), 6, new_tokens=3)
    assert capture.replays == 2
    runner.warm_decode(4)  # no --max-batch-size: the 39 blocks a 40-block pool hands out
    assert runner.graphs.batch_sizes == [1, 2, 4, 8, 16, 32, 39]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_on_a_gpu_give_the_eager_steps_tokens(tiny_llama):
    eager = make_engine(tiny_llama, device="cuda")
    graphed = make_engine(tiny_llama, device="cuda", cuda_graphs=[1, 2, 4], max_total_tokens=64)
    assert graphed.runner.graphs.captured
    for count, batched in ((1, False), (3, True), (4, True), (6, True)):
        assert _greedy(graphed, count, batched=batched) == _greedy(eager, count, batched=batched)


def test_rows_past_an_image_replay_at_their_multimodal_positions(tmp_path):
    """Qwen2.5-VL rows decode at length plus rope delta: the graphs take those positions, and
    give the eager steps' tokens for rows with an image beside a text-only one."""
    from tests.parity.test_qwen2_5_vl_parity import FILES, _request, with_images
    from tests.tiny_models import build_tiny_qwen2_5_vl

    model_dir = build_tiny_qwen2_5_vl(tmp_path)
    capture = EmulatedCapture()
    graphed = make_engine(model_dir, cuda_graphs=[4], new_capture=capture, max_total_tokens=64)
    eager = make_engine(model_dir)
    files = [[FILES[0]], FILES[1:3], []]
    prompts = [with_images([[5, 17], [42, 99]], files[0]),
               with_images([[30], [32, 33], [34]], files[1]), ([40, 41, 42], [])]

    def greedy(engine) -> dict[int, list[tuple[int, float]]]:
        pool, got = BlockPool(512), {0: [], 1: [], 2: []}
        for out in steps_to_completion(engine, [
                _request(i, ids, offsets, fs, pool.take(len(ids) + 8, 4), 8)
                for i, ((ids, offsets), fs) in enumerate(zip(prompts, files))]):
            for g in out.generations:
                got[g.request_id] += zip(g.tokens.ids, g.tokens.logprobs)
        return got

    replayed, stepped = greedy(graphed), greedy(eager)
    assert capture.replays == 7
    for row in range(3):
        assert [t for t, _ in replayed[row]] == [t for t, _ in stepped[row]]
        assert max(abs(a - b) for (_, a), (_, b) in zip(replayed[row], stepped[row])) <= 1e-4


@pytest.mark.parametrize("max_batch_size", [12, None])
def test_the_routers_max_batch_size_reaches_the_warm_up(max_batch_size):
    """--max-batch-size travels in the Warmup message (unset: none) to the engine's warm-up."""
    import asyncio

    from router.shards.convert import warmup_message
    from router.shards.step_types import NewBatch
    from shard.outputs import WarmupResult
    from shard.server import ShardServicer

    message = warmup_message(NewBatch(0, [], 0, 0), max_input_tokens=8, max_prefill_tokens=8,
                             max_total_tokens=16, max_batch_total_tokens=64,
                             max_batch_size=max_batch_size)
    got = []

    class Engine:
        hidden_size = 64

        def warmup(self, requests, total_tokens, max_total_tokens, batch_size):
            got.append((total_tokens, max_total_tokens, batch_size))
            return WarmupResult(num_blocks=17, block_size=4)

    servicer = ShardServicer.__new__(ShardServicer)  # no engine thread or model needed
    servicer.engine, servicer.info, servicer._worker = Engine(), None, None
    reply = asyncio.run(servicer.Warmup(message, None))
    assert got == [(64, 16, max_batch_size)] and reply.num_blocks == 17
