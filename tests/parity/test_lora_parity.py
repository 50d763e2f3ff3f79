"""LoRA adapters through our layers against transformers + peft on tiny random weights: logits
through the paged cache, and each request of a batch mixing adapters getting its own update."""
import pytest
import torch

from shard.adapters.adapter_set import MAX_RANK
from shard.adapters.peft_files import AdapterError
from shard.model_runner import PrefillSequence
from tests.lora_adapters import ATTENTION, build_adapter, reference_model
from tests.parity.test_llama_parity import _runner
from tests.tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    model_dir = build_tiny_model(root / "model", num_heads=4, num_kv_heads=2)
    adapters = {
        "all": build_adapter(model_dir, root / "all", rank=8, alpha=16, seed=1),
        "attn": build_adapter(model_dir, root / "attn", rank=4, alpha=8, targets=ATTENTION,
                              seed=2),
        "rs": build_adapter(model_dir, root / "rs", rank=16, alpha=4, seed=3, rslora=True,
                            targets=["q_proj", "v_proj", "down_proj"]),
    }
    return model_dir, adapters


@pytest.mark.parametrize("adapter", ["all", "attn", "rs"])
def test_logits_match_peft_through_paged_cache(tiny, adapter):
    model_dir, adapters = tiny
    runner = _runner(model_dir)
    slot = runner.adapters.slot_of(runner.adapters.load(adapter, adapters[adapter]).name)
    reference = reference_model(model_dir, adapters[adapter])
    prompt, blocks = [5, 17, 42, 99, 3, 250, 7], [9, 3, 14, 1, 20, 30]
    out = runner.prefill([PrefillSequence(prompt, 0, blocks, adapter_slot=slot)],
                         all_logits_rows={0})
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0]
        base = reference_model(model_dir, None)(torch.tensor([prompt])).logits[0]
    assert (expected - base).abs().max().item() > 0.05  # the adapter changes the model
    assert (out.full[0] - expected).abs().max().item() <= 1e-4
    tokens, seq_lens = list(prompt), torch.tensor([len(prompt)])
    table = torch.tensor([blocks])
    next_id = out.last.argmax(-1)
    for _ in range(6):
        tokens.append(int(next_id))
        logits = runner.decode(next_id, seq_lens, table, torch.tensor([slot])).logits
        with torch.no_grad():
            expected = reference(torch.tensor([tokens])).logits[0, -1]
        assert (logits[0] - expected).abs().max().item() <= 1e-4
        seq_lens, next_id = seq_lens + 1, logits.argmax(-1)


def test_mixed_batch_rows_get_their_own_adapter(tiny):
    """The base and two adapters in one prefill and one decode step: each row's logits are the
    ones it gets alone."""
    model_dir, adapters = tiny
    runner = _runner(model_dir)
    slots = {name: runner.adapters.load(name, adapters[name]).slot for name in ("all", "attn")}
    prompts = [[5, 17, 42, 99], [11, 12, 13], [200, 201, 202, 203, 204], [7, 8]]
    choice = [slots["all"], -1, slots["attn"], slots["all"]]
    blocks = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]]

    def run(rows):
        seqs = [PrefillSequence(prompts[i], 0, blocks[i], adapter_slot=choice[i]) for i in rows]
        prefill = runner.prefill(seqs).last
        ids = prefill.argmax(-1)
        lens = torch.tensor([len(prompts[i]) for i in rows])
        table = torch.tensor([blocks[i] for i in rows])
        decode = runner.decode(ids, lens, table, torch.tensor([choice[i] for i in rows])).logits
        return prefill, decode

    together = run([0, 1, 2, 3])
    for i in range(4):
        alone = run([i])
        assert torch.allclose(together[0][i], alone[0][0], atol=1e-5)
        assert torch.allclose(together[1][i], alone[1][0], atol=1e-5)
    base = reference_model(model_dir, None)
    with torch.no_grad():
        assert torch.allclose(together[0][1], base(torch.tensor([prompts[1]])).logits[0, -1],
                              atol=1e-4)


def test_bad_adapters_are_refused_and_change_nothing(tiny, tmp_path):
    model_dir, adapters = tiny
    runner = _runner(model_dir)
    runner.adapters.load("all", adapters["all"])
    # trained on a model whose k_proj and v_proj have twice the rows (4 KV heads, not 2)
    other = build_tiny_model(tmp_path / "other", num_heads=4, num_kv_heads=4, seed=5)
    foreign = build_adapter(other, tmp_path / "foreign", rank=4, targets=["q_proj", "k_proj"])
    with pytest.raises(AdapterError, match="trained on another base model"):
        runner.adapters.load("foreign", foreign)
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        runner.adapters.load("missing", tmp_path)
    big = build_adapter(model_dir, tmp_path / "big", rank=MAX_RANK * 2, alpha=16, targets=["q_proj"])
    with pytest.raises(AdapterError, match=f"ranks up to {MAX_RANK}"):
        runner.adapters.load("big", big)
    embed = build_adapter(model_dir, tmp_path / "embed", rank=4, targets=["q_proj", "embed_tokens"])
    with pytest.raises(AdapterError, match="embed_tokens"):
        runner.adapters.load("embed", embed)
    (tmp_path / "nofile").mkdir()
    (tmp_path / "nofile" / "adapter_config.json").write_text('{"r": 4, "lora_alpha": 8}')
    with pytest.raises(AdapterError, match="no adapter_model"):
        runner.adapters.load("nofile", tmp_path / "nofile")
    assert list(runner.adapters.adapters) == ["all"]


def _family(name, out):
    """A tiny model of another family, as its own parity tests build it."""
    from tests.parity.test_gemma_parity import build_tiny_gemma
    from tests.parity.test_phi3_parity import build_tiny_phi3
    from tests.parity.test_qwen3_parity import build_tiny_qwen3
    from tests.tiny_models import build_tokenizer

    if name == "phi3-partial":  # fused qkv_proj / gate_up_proj, rows in its own order
        (out / "tok").mkdir(parents=True)
        build_tokenizer(out / "tok")
        return build_tiny_phi3(out / "model", out / "tok", partial=0.75), ["qkv_proj", "o_proj",
                                                                            "gate_up_proj",
                                                                            "down_proj"]
    if name == "gemma3":
        return build_tiny_gemma(out / "model", 3), None
    if name == "qwen3-moe":  # the attention of a mixture-of-experts model
        return build_tiny_qwen3(out / "model", moe=True), ATTENTION
    return build_tiny_qwen3(out / "model", moe=False), None


@pytest.mark.parametrize("family", ["phi3-partial", "gemma3", "qwen3", "qwen3-moe"])
def test_other_families_match_peft(tmp_path, family):
    model_dir, targets = _family(family, tmp_path)
    adapter_dir = build_adapter(model_dir, tmp_path / "adapter", rank=8, alpha=16, std=0.1,
                                targets=targets)
    runner = _runner(model_dir)
    slot = runner.adapters.load("a", adapter_dir).slot
    reference = reference_model(model_dir, adapter_dir)
    prompts, blocks = [[5, 17, 42, 99, 3, 250, 7], [11, 12, 13]], [[9, 3, 14, 1], [2, 8, 13, 4]]
    out = runner.prefill([PrefillSequence(prompts[0], 0, blocks[0], adapter_slot=slot),
                          PrefillSequence(prompts[1], 0, blocks[1])], all_logits_rows={0, 1})
    with torch.no_grad():
        adapted = reference(torch.tensor([prompts[0]])).logits[0]
        base = reference_model(model_dir, None)(torch.tensor([prompts[1]])).logits[0]
    assert (out.full[0] - adapted).abs().max().item() <= 1e-4
    assert (out.full[1] - base).abs().max().item() <= 1e-4
    tokens = list(prompts[0]) + [int(out.last[0].argmax())]
    logits = runner.decode(torch.tensor([tokens[-1]]), torch.tensor([len(prompts[0])]),
                           torch.tensor([blocks[0]]), torch.tensor([slot])).logits
    with torch.no_grad():
        expected = reference(torch.tensor([tokens])).logits[0, -1]
    assert (logits[0] - expected).abs().max().item() <= 1e-4


def test_moe_experts_are_refused(tmp_path):
    """An adapter that also changes the experts of a mixture-of-experts layer is refused whole:
    only the attention and dense MLP projections take LoRA updates here."""
    from safetensors.torch import load_file, save_file

    model_dir, _ = _family("qwen3-moe", tmp_path)
    adapter_dir = build_adapter(model_dir, tmp_path / "adapter", rank=4, targets=["q_proj"])
    weights = load_file(str(adapter_dir / "adapter_model.safetensors"))
    expert = "base_model.model.model.layers.0.mlp.experts.0.gate_proj"
    weights[f"{expert}.lora_A.weight"] = torch.ones(4, 64)
    weights[f"{expert}.lora_B.weight"] = torch.ones(32, 4)
    save_file(weights, str(adapter_dir / "adapter_model.safetensors"))
    runner = _runner(model_dir)
    with pytest.raises(AdapterError, match="mlp.experts.0.gate_proj, which is not a projection"):
        runner.adapters.load("a", adapter_dir)
    assert not runner.adapters.adapters


def test_a_load_that_fails_half_way_leaves_nothing_behind(tiny, monkeypatch):
    """Out of memory while placing an adapter: the slot it took gets nothing of it, so the next
    adapter there serves exactly its own update."""
    model_dir, adapters = tiny
    runner, clean = _runner(model_dir), _runner(model_dir)
    for r in (runner, clean):
        r.adapters.load("attn", adapters["attn"])
    original, calls = runner.adapters._target, []

    def failing(linear):
        calls.append(linear)
        if len(calls) > 8:  # after 8 of the 21 modules "all" changes
            raise MemoryError("no room")
        return original(linear)

    monkeypatch.setattr(runner.adapters, "_target", failing)
    version = runner.adapters.version
    with pytest.raises(MemoryError):
        runner.adapters.load("all", adapters["all"])
    assert runner.adapters.version > version and "all" not in runner.adapters.adapters
    monkeypatch.setattr(runner.adapters, "_target", original)
    slots = [r.adapters.load("rs", adapters["rs"]).slot for r in (runner, clean)]
    assert slots[0] == slots[1]
    seqs = [PrefillSequence([5, 17, 42, 99], 0, [1, 2], adapter_slot=slots[0])]
    assert torch.equal(runner.prefill(seqs).last, clean.prefill(seqs).last)
