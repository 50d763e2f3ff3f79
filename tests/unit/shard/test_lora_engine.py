"""LoRA adapters through the engine: requests name adapters, a batch mixes them with the base,
beams and draft tokens carry their request's adapter, unknown names and busy unloads refused."""
import weakref

import pytest
import torch

from shard.engine import AdapterInUse
from tests.engine_helpers import (BlockPool, make_engine, request, run_to_completion,
                                  steps_to_completion)
from tests.lora_adapters import ATTENTION, build_adapter, greedy_reference, reference_model
from tests.tiny_models import build_tiny_model

PROMPTS = [[5, 17, 42, 99, 3], [11, 12, 13], [200, 201, 202, 203, 204, 205], [7, 8, 9, 10]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-engine")
    model_dir = build_tiny_model(root / "model", num_heads=4, num_kv_heads=2)
    return model_dir, {
        "one": build_adapter(model_dir, root / "one", rank=8, alpha=16, seed=1, std=0.1),
        "two": build_adapter(model_dir, root / "two", rank=4, alpha=8, targets=ATTENTION,
                             seed=2, std=0.1),
    }


def _requests(pool, adapters, **params):
    out = []
    for i, (prompt, adapter) in enumerate(zip(PROMPTS, adapters)):
        r = request(i + 1, prompt, pool.take(len(prompt) + 12, 4), max_new_tokens=10,
                    ignore_eos=True, **params)
        r.adapter = adapter
        out.append(r)
    return out


def test_mixed_batch_equals_peft_and_each_request_alone(tiny):
    model_dir, adapters = tiny
    engine = make_engine(model_dir)
    for name, path in adapters.items():
        engine.load_adapter(name, str(path))
    choice = ["one", None, "two", "one"]
    together = run_to_completion(engine, _requests(BlockPool(512), choice))
    for i, (prompt, adapter) in enumerate(zip(PROMPTS, choice)):
        alone = run_to_completion(engine, [_requests(BlockPool(512), choice)[i]], batch_id=9)
        assert alone[i + 1] == together[i + 1]
        reference = reference_model(model_dir, adapters[adapter] if adapter else None)
        assert together[i + 1] == greedy_reference(reference, prompt, 10)
    # the adapters change the text (else this test would prove nothing)
    base = run_to_completion(engine, _requests(BlockPool(512), [None] * 4))
    assert base[1] != together[1] and base[3] != together[3]


def test_beams_and_speculation_carry_the_adapter(tiny):
    model_dir, adapters = tiny
    plain = make_engine(model_dir)
    drafting = make_engine(model_dir, speculate=2)
    for engine in (plain, drafting):
        engine.load_adapter("one", str(adapters["one"]))
    choice = ["one", None, "one", None]
    assert (run_to_completion(drafting, _requests(BlockPool(512), choice))
            == run_to_completion(plain, _requests(BlockPool(512), choice)))
    # beam search: each beam row is its request's; alone it answers as in the mixed batch
    def beamed(adapters, only=None):
        pool = BlockPool(512)
        requests = _requests(pool, adapters)
        for r in requests:  # each beam writes its own blocks past the prompt
            r.num_beams, r.blocks = 2, pool.take(3 * (r.prompt_length + 12), 4)
            r.ignore_eos = False  # beam search takes none
        if only is not None:
            requests = [requests[only]]
        texts = {}
        for out in steps_to_completion(plain, requests, batch_id=5):
            texts.update({g.request_id: g.generated_text.token_ids for g in out.generations
                          if g.generated_text is not None})
        return texts

    mixed = beamed(choice)
    assert mixed[1] == beamed(choice, only=0)[1] and mixed[2] == beamed(choice, only=1)[2]
    assert mixed[1] != beamed([None] * 4)[1]


def test_unknown_adapter_refuses_that_request_alone(tiny):
    model_dir, adapters = tiny
    engine = make_engine(model_dir)
    engine.load_adapter("one", str(adapters["one"]))
    requests = _requests(BlockPool(512), ["one", "nope", None, "one"])
    out = engine.prefill(1, requests)
    assert [rid for rid, _ in out.rejected] == [2]
    assert "'nope' is not loaded" in out.rejected[0][1]
    assert sorted(out.batch.request_ids) == [1, 3, 4]


def test_unload_waits_for_no_request_and_frees_the_layers(tiny):
    model_dir, adapters = tiny
    engine = make_engine(model_dir)
    engine.load_adapter("one", str(adapters["one"]))
    out = engine.prefill(1, _requests(BlockPool(512), ["one", None, None, None]))
    with pytest.raises(AdapterInUse):
        engine.unload_adapter("one")
    engine.clear(out.batch.id)
    engine.unload_adapter("one")
    with pytest.raises(KeyError):
        engine.unload_adapter("one")
    layers = engine.runner.model.layers
    assert all(layer.self_attn.qkv_proj.lora is None for layer in layers)
    # loaded again, it serves as before
    engine.load_adapter("one", str(adapters["one"]))
    again = run_to_completion(engine, _requests(BlockPool(512), ["one"] * 4))
    reference = reference_model(model_dir, adapters["one"])
    assert again[1] == greedy_reference(reference, PROMPTS[0], 10)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("cuda_graphs", [None, [1, 2, 4]], ids=["eager", "graphs-captured"])
def test_mixed_batch_on_cuda_gives_the_cpu_tokens(tiny, cuda_graphs):
    """The masked-matmul path on a GPU; an engine with CUDA graphs captured runs adapter batches
    eagerly (its graphs hold no adapter updates) and still gives the same tokens."""
    model_dir, adapters = tiny
    choice = ["one", None, "two", "one"]
    tokens = {}
    for device in ("cpu", "cuda"):
        engine = make_engine(model_dir, device=device,
                             cuda_graphs=cuda_graphs if device == "cuda" else None)
        for name, path in adapters.items():
            engine.load_adapter(name, str(path))
        tokens[device] = run_to_completion(engine, _requests(BlockPool(512), choice))
        tokens[device, "base"] = run_to_completion(engine, _requests(BlockPool(512), [None] * 4))
    assert tokens["cuda"] == tokens["cpu"]
    assert tokens["cuda", "base"] == tokens["cpu", "base"]


def test_an_unload_moves_the_last_adapter_into_the_free_slot_and_its_requests_follow(tiny):
    """Slots stay dense: unloading slot 0 mid-generation moves the adapter of slot 1 there, and
    the running requests on it get exactly the tokens of a run without the unload."""
    model_dir, adapters = tiny

    def generate(choice: list, unload_midway: bool) -> dict:
        engine = make_engine(model_dir)
        engine.load_adapter("gone", str(adapters["two"]))
        engine.load_adapter("kept", str(adapters["one"]))
        tokens = {i + 1: [] for i in range(4)}
        for step, out in enumerate(steps_to_completion(engine, _requests(BlockPool(512), choice))):
            for generation in out.generations:
                tokens[generation.request_id] += generation.tokens.ids
            if step == 1 and unload_midway:
                engine.unload_adapter("gone")
                assert engine.runner.adapters.slot_of("kept") == 0
        return tokens

    choice = ["kept", None, "kept", None]
    undisturbed = generate(choice, unload_midway=False)
    assert generate(choice, unload_midway=True) == undisturbed
    assert generate([None] * 4, unload_midway=False) != undisturbed  # the adapter counts


def test_stacks_double_as_adapters_load_and_unloads_give_their_memory_back(tiny):
    """A load copies the loaded adapters only when the stacks' room crosses a power of two (loads
    do not slow down as adapters add up); unloads shrink the stacks, and nothing (the C decode
    step included) keeps the freed ones."""
    model_dir, adapters = tiny
    engine = make_engine(model_dir, dtype=torch.bfloat16)
    held = engine.runner.adapters
    stack = lambda: engine.runner.model.layers[0].self_attn.qkv_proj.lora.parts[0].a  # noqa: E731
    rooms, moves = [], 0
    for i in range(9):
        before = stack().data_ptr() if i else None
        engine.load_adapter(f"a{i}", str(adapters["one"]))
        rooms.append(stack().shape[0])
        moves += stack().data_ptr() != before
        if i == 0:
            one_adapter = held.tensor_bytes()
    assert rooms == [1, 2, 4, 4, 8, 8, 8, 8, 16] and moves == 5
    assert held.tensor_bytes() == 16 * one_adapter
    run_to_completion(engine, _requests(BlockPool(512), ["a8", None, "a3", None]))
    freed = weakref.ref(stack())  # the C decode step pointed into it
    for i in range(8):
        engine.unload_adapter(f"a{i}")
    assert held.tensor_bytes() == one_adapter and stack().shape[0] == 1
    assert freed() is None
    engine.unload_adapter("a8")
    assert held.tensor_bytes() == 0
    assert all(layer.self_attn.qkv_proj.lora is None for layer in engine.runner.model.layers)
