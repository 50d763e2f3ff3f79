"""The decode step in C gives the eager step's logits, hidden states and cache writes bit for bit,
and steps aside (saying why) where one of its kernels is not what the eager step would run."""
import weakref

import pytest
import torch

from shard import model_runner as model_runner_module
from shard.decode_paths import c_step
from shard.decode_paths.compiled import CompiledDecode
from shard.distributed import ParallelContext
from shard.kernels import bf16_matmul, int4_matmul, layer_ops, lora, paged_attention
from shard.kv_budget import KVCacheSpec, allocate_kv_cache
from shard.layers import linear, precision
from shard.loader import load_model
from shard.model_runner import ModelRunner, PrefillSequence
from tests.lora_adapters import ATTENTION, build_adapter
from tests.tiny_models import build_tiny_model


def _runner(model_dir, dtype=torch.bfloat16, compile_decode=False, quantize=None,
            blocks=64, kv_int8=False) -> ModelRunner:
    loaded = load_model(model_dir, dtype=dtype, device=torch.device("cpu"),
                        parallel=ParallelContext(), quantize=quantize)
    cfg = loaded.config
    spec = KVCacheSpec(cfg.num_hidden_layers, loaded.heads.num_kv_heads, cfg.head_dim, 4, dtype,
                       torch.device("cpu"), int8=kv_int8)
    runner = ModelRunner(loaded.model, spec, compile_decode=compile_decode)
    runner.allocate(blocks)
    return runner


def _needs_c_step(runner: ModelRunner) -> None:
    reason = c_step.unsupported_reason(runner.model.decode_layout(), runner.cache)
    if reason is not None:
        pytest.skip(f"no C decode step here: {reason}")


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("qwen2"), architecture="qwen2")


@pytest.fixture(scope="module")
def ragged_dir(tmp_path_factory):
    """Widths that are not multiples of the matmul's 16-feature blocks (vocabulary 333, hidden 80,
    intermediate 100), head_dim 16 with 5 query heads over one KV head, tied embeddings."""
    import transformers

    out = build_tiny_model(tmp_path_factory.mktemp("ragged"))  # for its tokenizer
    torch.manual_seed(3)
    config = transformers.LlamaConfig(
        vocab_size=333, hidden_size=80, intermediate_size=100, num_hidden_layers=2,
        num_attention_heads=5, num_key_value_heads=1, max_position_embeddings=256,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    transformers.LlamaForCausalLM(config).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory):
    """Phi-3 laid out as Llama once loaded: fused checkpoint tensors, LongRoPE, partial rotation
    (Phi-4-mini's 0.75) carried in the rotary tables."""
    from tests.parity.test_phi3_parity import build_tiny_phi3

    tokenizer_dir = build_tiny_model(tmp_path_factory.mktemp("phi3-tokenizer"))
    return build_tiny_phi3(tmp_path_factory.mktemp("phi3"), tokenizer_dir, longrope=True,
                           partial=0.75)


def _assert_steps_agree(runner: ModelRunner, ids, lens, tables,
                        row_slots: torch.Tensor | None = None,
                        positions: torch.Tensor | None = None) -> torch.Tensor:
    """One C step and one eager step from the same cache (each row with the update of its LoRA
    slot where row_slots are given): the same logits, hidden states and cache writes, bit for bit
    (the cache is left as the eager step wrote it). The C step's logits."""
    before = [_cache_tensors(c, clone=True) for c in runner.cache]
    with torch.inference_mode():
        logits, hidden = runner.c_step(ids, lens, tables, row_slots=row_slots,
                                       positions=positions)
        written = [_cache_tensors(c, clone=True) for c in runner.cache]
        for c, saved in zip(runner.cache, before):
            for tensor, old in zip(_cache_tensors(c), saved):
                tensor.copy_(old)
        with runner.adapters.applied(row_slots):
            eager_logits, eager_hidden = runner._decode_forward(ids, lens, tables, positions)
    assert logits.dtype == eager_logits.dtype == torch.float32
    assert torch.equal(logits, eager_logits)
    assert torch.equal(hidden, eager_hidden)
    assert all(torch.equal(a, b) for saved, c in zip(written, runner.cache)
               for a, b in zip(saved, _cache_tensors(c)))
    return logits


def _cache_tensors(layer, clone=False) -> list[torch.Tensor]:
    """A layer's keys and values, and an int8 cache's scales."""
    tensors = [layer.key, layer.value]
    if layer.is_int8:
        tensors += [layer.key_scale, layer.value_scale]
    return [t.clone() for t in tensors] if clone else tensors


_LIBRARIES = (layer_ops.load_library, paged_attention.load_kernel, bf16_matmul.load_library,
              int4_matmul.load_library, c_step.load_library, lora.load_library)


@pytest.fixture(params=["native", "avx2"])
def kernel_build(request, monkeypatch):
    """The kernels as this CPU builds them, and as an AVX2-only CPU does (-march=x86-64-v3, where
    oneDNN has no bf16 kernels and the matmul multiplies in float32), on any CPU that runs AVX2."""
    if request.param == "avx2":
        request.getfixturevalue("avx2_build")
        for module in (precision, linear):
            monkeypatch.setattr(module, "cpu_has_bf16_kernels", lambda: False)
    for load in _LIBRARIES:
        load.cache_clear()
    yield request.param
    for load in _LIBRARIES:
        load.cache_clear()


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "ragged", "phi3"])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_c_step_equals_the_eager_step(tiny_llama, qwen2_dir, ragged_dir, phi3_dir, architecture,
                                      batch, kernel_build):
    """Llama, Qwen2's biased q/k/v projections and Phi-3; contexts of different lengths across
    several blocks, two steps in a row (the second reads the keys the first wrote)."""
    runner = _runner({"llama": tiny_llama, "qwen2": qwen2_dir, "ragged": ragged_dir,
                      "phi3": phi3_dir}[architecture])
    if kernel_build == "avx2":
        assert bf16_matmul.load_library().bf16_matmul_supported() == bf16_matmul.AVX2_FORM
        assert runner.model.activation_dtype == torch.bfloat16
    _needs_c_step(runner)
    assert runner.c_step is not None
    torch.manual_seed(batch)
    seqs = [PrefillSequence(token_ids=torch.randint(3, 300, (5 + 3 * b,)).tolist(), start=0,
                            blocks=list(range(1 + 7 * b, 8 + 7 * b))) for b in range(batch)]
    runner.prefill(seqs)
    tables = torch.tensor([s.blocks for s in seqs])
    lens = torch.tensor([s.length for s in seqs])
    if architecture == "ragged":  # int32 inputs, a table that is a view with a row stride of 14
        lens = lens.int()
        tables = torch.cat([tables.int(), tables.int()], 1)[:, :7]
        assert batch == 1 or not tables.is_contiguous()
    for step in range(2):
        _assert_steps_agree(runner, torch.randint(3, 300, (batch,)), lens + step, tables)


@pytest.mark.parametrize("architecture", ["llama", "ragged"])
@pytest.mark.parametrize("batch", [1, 8])
def test_c_step_over_an_int8_cache_equals_the_eager_step(tiny_llama, ragged_dir, architecture,
                                                         batch, kernel_build):
    """--kv-cache-dtype int8: the C step writes the same int8 rows and scales and reads them
    into the same logits as the eager step."""
    runner = _runner({"llama": tiny_llama, "ragged": ragged_dir}[architecture], kv_int8=True)
    _needs_c_step(runner)
    assert runner.c_step is not None and runner.cache[0].key.dtype == torch.int8
    torch.manual_seed(batch)
    seqs = [PrefillSequence(token_ids=torch.randint(3, 300, (5 + 3 * b,)).tolist(), start=0,
                            blocks=list(range(1 + 7 * b, 8 + 7 * b))) for b in range(batch)]
    runner.prefill(seqs)
    tables = torch.tensor([s.blocks for s in seqs])
    lens = torch.tensor([s.length for s in seqs])
    for step in range(2):
        _assert_steps_agree(runner, torch.randint(3, 300, (batch,)), lens + step, tables)


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_c_step_with_int4_layers_equals_the_eager_step(tiny_llama, qwen2_dir, architecture,
                                                       kernel_build):
    """--quantize int4 where our int4 kernel runs: batches up to its tile rows multiply the 4-bit
    forms, larger ones the bf16 weights they stand for (unpacked on the fly; on AVX2 every batch
    the 4-bit forms), in both steps alike."""
    if int4_matmul.load_library() is None:
        pytest.skip("the C int4 matmul needs AVX-512 BF16 or AVX2, and a C compiler")
    tiles = int4_matmul.tile_rows() or 8
    runner = _runner({"llama": tiny_llama, "qwen2": qwen2_dir}[architecture], quantize="int4",
                     blocks=2 * tiles + 4)
    if linear.c_int4_runs():  # int4 layers must not cost the C step
        assert c_step.unsupported_reason(runner.model.decode_layout(), runner.cache) is None
    _needs_c_step(runner)
    own = [m.prepared for m in runner.model.layers.modules() if hasattr(m, "prepared")]
    assert own and all(p.quantized.kernel == "c" for p in own)
    for batch in (1, 3, tiles, tiles + 1):
        torch.manual_seed(batch)
        seqs = [PrefillSequence(token_ids=torch.randint(3, 300, (3 + b % 5,)).tolist(), start=0,
                                blocks=[1 + 2 * b, 2 + 2 * b]) for b in range(batch)]
        runner.prefill(seqs)
        tables = torch.tensor([s.blocks for s in seqs])
        lens = torch.tensor([s.length for s in seqs])
        _assert_steps_agree(runner, torch.randint(3, 300, (batch,)), lens, tables)


def test_runner_decodes_through_the_c_step(tiny_llama, monkeypatch):
    runner = _runner(tiny_llama)
    _needs_c_step(runner)
    calls = []
    step = runner.c_step
    monkeypatch.setattr(runner, "c_step",
                        lambda *args, **kwargs: calls.append(args) or step(*args, **kwargs))
    runner.prefill([PrefillSequence(token_ids=[5, 6, 7], start=0, blocks=[1, 2])])
    out = runner.decode(torch.tensor([9]), torch.tensor([3]), torch.tensor([[1, 2]]))
    assert len(calls) == 1 and out.logits.shape[0] == 1


def test_a_slot_outside_the_cache_raises(tiny_llama):
    runner = _runner(tiny_llama)
    _needs_c_step(runner)
    for position, table in ((3, [999, 1]), (5, [1, 999]), (5, [1, -2])):
        with pytest.raises(IndexError), torch.inference_mode():
            runner.c_step(torch.tensor([9]), torch.tensor([position]), torch.tensor([table]))


def test_float32_models_and_switched_off_builds_keep_the_eager_step(tiny_llama, monkeypatch):
    runner = _runner(tiny_llama, dtype=torch.float32)
    assert runner.c_step is None
    assert "bf16" in c_step.unsupported_reason(runner.model.decode_layout(), runner.cache)
    monkeypatch.setattr(c_step, "load_library", lambda: None)
    runner = _runner(tiny_llama)
    assert runner.c_step is None
    assert c_step.unsupported_reason(runner.model.decode_layout(), runner.cache) is not None


def test_a_compiled_step_asked_for_is_what_runs(tiny_llama):
    runner = _runner(tiny_llama, compile_decode=True)
    _needs_c_step(runner)  # where the C step would run, the compiled one takes its place
    assert isinstance(runner.decode_step, CompiledDecode)
    assert runner.c_step is None


def test_inputs_that_disagree_are_refused_before_the_c_loop(tiny_llama):
    runner = _runner(tiny_llama)
    _needs_c_step(runner)
    with pytest.raises(ValueError), torch.inference_mode():
        runner.c_step(torch.tensor([9, 10]), torch.tensor([3]), torch.tensor([[1, 2], [3, 4]]))
    with pytest.raises(ValueError), torch.inference_mode():
        runner.c_step(torch.tensor([9, 10]), torch.tensor([3, 3]), torch.tensor([[1, 2]]))


def test_a_refused_compilation_keeps_the_c_step(tiny_llama, monkeypatch):
    monkeypatch.setattr(model_runner_module, "unsupported_reason", lambda *args: "refused here")
    runner = _runner(tiny_llama, compile_decode=True)
    _needs_c_step(runner)
    assert not isinstance(runner.decode_step, CompiledDecode)
    assert runner.c_step is not None


def test_a_new_pool_is_allocated_after_the_old_one_is_freed(tiny_llama, monkeypatch):
    runner = _runner(tiny_llama)
    _needs_c_step(runner)  # the C step is what held the old pool
    old = weakref.ref(runner.cache[0].key)
    seen = []
    allocate = model_runner_module.allocate_kv_cache
    monkeypatch.setattr(model_runner_module, "allocate_kv_cache",
                        lambda *args: seen.append(old() is None) or allocate(*args))
    runner.allocate(32)
    assert seen == [True]


def test_a_cpu_pool_takes_memory_as_its_blocks_are_written():
    """The KV pool on the CPU is mapped, not written, at allocation: 512 MiB of pool add almost
    nothing resident until blocks are written, and read as zeros until then."""
    from pathlib import Path


    def resident_mib():
        line = next(x for x in Path("/proc/self/status").read_text().splitlines()
                    if x.startswith("VmRSS:"))
        return int(line.split()[1]) / 1024

    spec = KVCacheSpec(num_layers=8, num_kv_heads=4, block_size=16, head_dim=64,
                       dtype=torch.bfloat16, device=torch.device("cpu"))
    blocks = (512 << 20) // spec.bytes_per_block
    before = resident_mib()
    pool = allocate_kv_cache(spec, blocks)
    assert resident_mib() - before < 32
    layer = pool[3]
    assert layer.key.shape == (blocks, 4, 16, 64) and layer.key.dtype == torch.bfloat16
    layer.key[7] = 1.5
    layer.value[blocks - 1, 2] = -2.0
    assert float(layer.key[7].float().mean()) == 1.5 and float(layer.value[blocks - 1].sum()) == -2048
    assert not layer.key[6].any() and not pool[0].value.any()
    assert resident_mib() - before < 64 + 2 * 128  # the two full layers read, one block written


_PHI3_LINEAR = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]


@pytest.mark.parametrize("architecture", ["llama", "ragged", "phi3", "int4"])
def test_c_step_with_lora_adapters_equals_the_eager_step(tiny_llama, ragged_dir, phi3_dir,
                                                         architecture, kernel_build, tmp_path):
    """Two adapters (every projection at rank 8; attention alone at rank 4, so some parts have a
    rank-0 slot) mixed with base rows in one batch, Phi-3's fused q/k/v and gate/up parts and
    int4 layers among them; then after unloading one (the other moved into its slot, the stacks'
    pointers set again) and both (no update at all)."""
    model_dir = {"llama": tiny_llama, "ragged": ragged_dir, "phi3": phi3_dir,
                 "int4": tiny_llama}[architecture]
    targets = _PHI3_LINEAR if architecture == "phi3" else None
    if architecture == "int4" and (int4_matmul.load_library() is None or not linear.c_int4_runs()):
        pytest.skip("the C int4 matmul does not run here")
    runner = _runner(model_dir, quantize="int4" if architecture == "int4" else None)
    _needs_c_step(runner)
    if lora.load_library() is None:
        pytest.skip("the C LoRA kernel did not build")
    assert runner.c_step.takes_adapters
    attention = targets[:2] if targets else ATTENTION
    for name, rank, only in (("one", 8, targets), ("two", 4, attention)):
        path = build_adapter(model_dir, tmp_path / name, rank=rank, alpha=2 * rank, targets=only,
                             seed=rank, std=0.1)
        runner.adapters.load(name, path)
    batch = 6
    torch.manual_seed(7)
    seqs = [PrefillSequence(token_ids=torch.randint(3, 300, (4 + 3 * b,)).tolist(), start=0,
                            blocks=list(range(1 + 6 * b, 7 + 6 * b))) for b in range(batch)]
    runner.prefill(seqs)
    tables = torch.tensor([s.blocks for s in seqs])
    lens = torch.tensor([s.length for s in seqs])
    ids = torch.randint(3, 300, (batch,))
    slots = torch.tensor([runner.adapters.slot_of("one"), -1, runner.adapters.slot_of("two"),
                          runner.adapters.slot_of("one"), -1, runner.adapters.slot_of("two")])
    with torch.inference_mode():
        base_logits, _ = runner.c_step(ids, lens, tables)
    with_lora = _assert_steps_agree(runner, ids, lens, tables, slots)
    is_base = slots < 0
    assert torch.equal(with_lora[is_base], base_logits[is_base])
    assert all(not torch.equal(with_lora[i], base_logits[i]) for i in range(batch) if slots[i] >= 0)
    # one row alone gets the bits it gets in the mixed batch
    alone = _assert_steps_agree(runner, ids[:1], lens[:1], tables[:1], slots[:1])
    assert torch.equal(alone[0], with_lora[0])

    assert runner.adapters.unload("one") == {1: 0}  # "two" moves into the slot "one" frees
    slots[slots == 0] = -1
    slots[slots == 1] = 0
    after = _assert_steps_agree(runner, ids, lens, tables, slots)
    is_two = slots == 0
    assert torch.equal(after[is_two], with_lora[is_two])
    runner.adapters.unload("two")
    no_adapters = _assert_steps_agree(runner, ids, lens, tables, torch.full((batch,), -1))
    assert torch.equal(no_adapters, base_logits)


def test_without_the_lora_kernel_the_c_step_refuses_adapters(tiny_llama, monkeypatch, tmp_path):
    """TGI_PY_LORA_KERNEL=0: the C step says it takes no adapters, and refuses a step that has
    some rather than leave their updates out."""
    monkeypatch.setattr(lora, "load_library", lambda: None)
    runner = _runner(tiny_llama)
    _needs_c_step(runner)
    assert not runner.c_step.takes_adapters
    runner.adapters.load("one", build_adapter(tiny_llama, tmp_path / "one", rank=4))
    runner.prefill([PrefillSequence(token_ids=[5, 6, 7], start=0, blocks=[1, 2])])
    args = (torch.tensor([9]), torch.tensor([3]), torch.tensor([[1, 2]]))
    with torch.inference_mode():
        runner.c_step(*args)
        with pytest.raises(RuntimeError):
            runner.c_step(*args, row_slots=torch.tensor([runner.adapters.slot_of("one")]))


@pytest.mark.parametrize("architecture", ["qwen3", "qwen3_moe", "gemma2", "gemma3"])
def test_families_that_declare_another_layer_keep_the_eager_step(tiny_llama, tmp_path,
                                                                 architecture):
    """The C step serves the families that declare Llama's layer (Llama, Qwen2, Mistral without
    a window, Phi-3: the tests above); the others declare what sets them apart."""
    from tests.parity.test_gemma_parity import build_tiny_gemma
    from tests.parity.test_qwen3_parity import build_tiny_qwen3

    if architecture.startswith("qwen3"):
        model_dir = build_tiny_qwen3(tmp_path, moe=architecture == "qwen3_moe",
                                     tokenizer_from=tiny_llama)
    else:
        model_dir = build_tiny_gemma(tmp_path, int(architecture[-1]))
    runner = _runner(model_dir)
    layout = runner.model.decode_layout()
    assert layout.departures() and runner.c_step is None
    reason = c_step.unsupported_reason(layout, runner.cache)
    assert reason.startswith(type(runner.model).__name__)


def test_c_step_at_multimodal_positions_equals_the_eager_step(tmp_path):
    """Qwen2.5-VL rows past an image decode at their length plus their rope delta: the C step
    rotates by those positions as the eager step does, bit for bit (and not by the lengths)."""
    from shard.batch_state import PromptImage
    from shard.models.mrope import mrope_positions, rope_delta
    from tests.parity.test_gemma3_vision_parity import image_bytes
    from tests.tiny_models import build_tiny_qwen2_5_vl

    runner = _runner(build_tiny_qwen2_5_vl(tmp_path))
    _needs_c_step(runner)
    preprocess = runner.model.image_preprocessor(tmp_path)
    data = image_bytes(40, 24, "PNG", 1)
    rows, columns = preprocess.grid(data)
    ids = [5, 320] + [322] * (rows * columns) + [321, 6, 7]
    images = [PromptImage(data, 2, rows * columns, preprocess(data), (rows, columns))]
    runner.prefill([PrefillSequence(ids, 0, list(range(1, 8)), images=images,
                                    rope_positions=mrope_positions(images, 0, len(ids))),
                    PrefillSequence([8, 9, 10], 0, [8])])
    lens, tables = torch.tensor([len(ids), 3]), torch.tensor([list(range(1, 8)), [8] * 7])
    positions = lens + torch.tensor([rope_delta(images), 0])
    assert positions[0] < lens[0]
    logits = _assert_steps_agree(runner, torch.tensor([11, 12]), lens, tables,
                                 positions=positions)
    # the runner's step for rows with rope deltas is this C step
    assert torch.equal(runner.decode(torch.tensor([11, 12]), lens, tables,
                                     rope_deltas=positions - lens).logits, logits)
    with torch.inference_mode():
        plain = runner.c_step(torch.tensor([11, 12]), lens, tables)[0]
    assert not torch.equal(logits[0], plain[0]) and torch.equal(logits[1], plain[1])
