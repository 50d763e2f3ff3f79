"""A Qwen3-MoE GGUF's expert stacks are served as stored, one matrix per expert, at the file's size."""
import json

import pytest
import torch

from launcher.gguf import convert_gguf
from launcher.gguf_architectures import GGUFError
from shard.distributed import ParallelContext
from shard.layers.ggml_quants import BlockRows, BlockStack
from shard.layers.linear import c_int4_runs, c_int8_runs
from shard.layers.moe import SparseMoeBlock
from shard.quantization_report import describe, served_types
from shard.weights import Weights
from tests.engine_helpers import prefill_logits
from tests.unit.launcher.tiny_moe_gguf import EXPERT_TYPES, write_moe_gguf

pytest.importorskip("gguf")

PROMPT = (5, 17, 42, 99, 3, 25, 7, 11, 30)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    tiny = write_moe_gguf(root / "moe.gguf")
    native = convert_gguf(tiny.path, root / "native", dtype="gguf")
    widened = convert_gguf(tiny.path, root / "float32", dtype="float32")
    return tiny, native, widened


def test_the_float32_conversion_is_the_model_the_file_was_made_from(converted):
    tiny, _, widened = converted
    config = json.loads((widened / "config.json").read_text())
    assert (config["model_type"], config["num_experts"], config["num_experts_per_tok"],
            config["moe_intermediate_size"], config["norm_topk_prob"]) == (
        "qwen3_moe", 4, 2, 256, True)
    import transformers

    _, ours = prefill_logits(widened, torch.float32, PROMPT)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(widened, dtype=torch.float32)
    with torch.no_grad():
        expected = tiny.model(torch.tensor([PROMPT])).logits[0].float()
        # the Hub's per-expert names, which transformers reads as it reads a Hub checkpoint
        theirs = reloaded.eval()(torch.tensor([PROMPT])).logits[0]
    assert (theirs - expected).abs().max() <= 1e-5 * expected.abs().max()
    assert (ours - expected).abs().max() <= 1e-4 * expected.abs().max()


def test_native_float32_serves_the_blocks_values_exactly(converted):
    tiny, native, widened = converted
    loaded, ours = prefill_logits(native, torch.float32, PROMPT)
    _, expected = prefill_logits(widened, torch.float32, PROMPT)
    assert torch.equal(ours, expected)
    # per layer: 4 experts' gate_up and down; gate_up counts once for each type it joins
    served = served_types(loaded.model)
    for gate, up, down in EXPERT_TYPES:
        for kind in {gate, up}:
            assert served[kind]["dequantized per layer"] >= 4, kind
        assert served[down]["dequantized per layer"] >= 4, down
    line = describe(loaded.model, loaded.quantization_config, None)
    assert "Q4_K in 4 layers" in line and "Q6_K in 4 layers" in line, line


def test_native_bf16_takes_the_kernels_within_bf16_rounding(converted):
    _, native, widened = converted
    loaded, ours = prefill_logits(native, torch.bfloat16, PROMPT)
    _, bf16 = prefill_logits(widened, torch.bfloat16, PROMPT)
    _, expected = prefill_logits(widened, torch.float32, PROMPT)
    # 3x, not 2x: the kernels round each row to int8 a group of inputs (AVX2, AVX-512 VNNI; as
    # llama.cpp rounds its activations), a step of 1/127 of the group's largest input, coarser than
    # bf16's 2^-8 of each input for all but the largest: 2.2x the bf16 model's error here
    assert (ours - expected).abs().max() <= 3 * (bf16 - expected).abs().max() + 1e-2
    line = describe(loaded.model, loaded.quantization_config, None)
    if c_int4_runs():  # layer 0's experts: gate and up Q4_K, one int4 form
        assert "Q4_K in 4 layers (int4 kernel)" in line, line
    if c_int8_runs():
        assert "Q6_K in 4 layers (int8 kernel)" in line, line


def test_the_native_conversion_is_the_files_size(converted):
    tiny, native, widened = converted
    gguf_bytes = tiny.path.stat().st_size
    native_bytes = sum(p.stat().st_size for p in native.glob("*.safetensors"))
    widened_bytes = sum(p.stat().st_size for p in widened.glob("*.safetensors"))
    assert native_bytes <= 1.02 * gguf_bytes < widened_bytes / 4
    blocks = Weights(native, dtype=torch.bfloat16, device=torch.device("cpu"),
                     parallel=ParallelContext()).blocks
    assert blocks["model.layers.0.mlp.experts.3.down_proj.weight"] == ("Q6_K", 256)
    assert blocks["model.layers.1.mlp.experts.0.up_proj.weight"] == ("Q4_0", 256)


def test_each_rank_reads_its_own_experts_blocks(converted):
    _, native, _ = converted
    prefix = "model.layers.0.mlp"
    whole = Weights(native, dtype=torch.float32, device=torch.device("cpu"),
                    parallel=ParallelContext())
    rank = Weights(native, dtype=torch.float32, device=torch.device("cpu"),
                   parallel=ParallelContext(rank=1, world_size=2))
    block = SparseMoeBlock.load(rank, prefix, num_experts=4, top_k=2, intermediate_size=256,
                                norm_topk_prob=True)
    assert block.first_expert == 2 and len(block.experts) == 2
    # /info counts the model's expert layers, every rank's: two here, four in all
    assert served_types(block) == {"Q4_K": {"dequantized per layer": 4},
                                   "Q6_K": {"dequantized per layer": 4}}
    for index, expert in enumerate(block.experts, start=2):
        stack = expert.gate_up_proj.prepared.blocks
        assert isinstance(stack, BlockStack) and stack.kinds == ("Q4_K",)
        base = f"{prefix}.experts.{index}"
        assert torch.equal(stack.dequantize(), torch.cat([
            whole.get(f"{base}.gate_proj.weight"), whole.get(f"{base}.up_proj.weight")]))
        down = expert.down_proj.prepared.blocks
        assert isinstance(down.parts[0], BlockRows)
        assert torch.equal(down.dequantize(), whole.get(f"{base}.down_proj.weight"))


def test_a_stack_that_disagrees_with_the_expert_count_is_refused(tmp_path):
    """One sentence naming the tensor, before anything is written."""
    import gguf

    from launcher.gguf import _experts
    from launcher.gguf_file import TensorInfo

    stack = TensorInfo("blk.0.ffn_up_exps.weight", (3, 64, 256),
                       int(gguf.GGMLQuantizationType.Q4_K), 0, 0)
    with pytest.raises(GGUFError, match=r"^tensor blk\.0\.ffn_up_exps\.weight is \[3, 64, 256\], "
                                        r"not a stack of the 4 experts"):
        _experts("model.layers.0.mlp.experts.{expert}.up_proj.weight", stack, {"num_experts": 4})
    assert _experts("model.layers.0.mlp.experts.{expert}.up_proj.weight", stack,
                    {"num_experts": 3}) == [0, 1, 2]


def test_a_stack_of_a_type_not_served_is_each_experts_bf16_logged_once(caplog):
    from types import SimpleNamespace

    import gguf

    from launcher.gguf import plan_tensors
    from launcher.gguf_architectures import ARCHITECTURES
    from launcher.gguf_file import TensorInfo

    stacks = [TensorInfo(f"blk.0.{kind}_exps.weight", (3, 64, 256), int(gguf.GGMLQuantizationType[
        type_name]), 0, 0) for kind, type_name in (("ffn_up", "Q2_K"), ("ffn_down", "Q4_K"))]
    with caplog.at_level("INFO", logger="tgi.launcher"):
        jobs = plan_tensors(SimpleNamespace(tensors=stacks), ARCHITECTURES["qwen3moe"],
                            {"num_experts": 3}, "gguf")
    assert [(job.spec.name, job.spec.dtype, job.spec.shape, job.blocks, job.first_row)
            for job in jobs] == [
        *((f"model.layers.0.mlp.experts.{e}.up_proj.weight", "BF16", (64, 256), "", 64 * e)
          for e in range(3)),
        *((f"model.layers.0.mlp.experts.{e}.down_proj.weight", "U8", (64, 144), "Q4_K", 64 * e)
          for e in range(3))]
    assert caplog.text.count("Q2_K is not served as stored") == 1
