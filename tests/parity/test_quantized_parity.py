"""--quantize int8|int4: every linear layer and the LM head multiply by their quantized weights, and
nothing else changes. The reference is transformers on a checkpoint whose linear weights were
replaced by what the quantized ones stand for (quantization is row by row, so quantizing q, k and v
apart equals quantizing their fused rows)."""
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from shard.distributed import ParallelContext
from shard.kernels import int4_matmul
from shard.kv_budget import KVCacheSpec
from shard.layers import linear as linear_module
from shard.layers.quantize import QUANTIZE_KINDS, dequantize, quantize, quantized_linear
from shard.loader import load_model
from shard.model_runner import ModelRunner, PrefillSequence
from tests.tiny_models import build_tiny_model


def _dequantized_copy(model_dir, out_dir, kind):
    shutil.copytree(model_dir, out_dir)
    for path in out_dir.glob("*.safetensors"):
        tensors = load_file(path)
        for name, tensor in tensors.items():
            if tensor.dim() == 2 and (name.endswith("proj.weight") or name == "lm_head.weight"):
                q, restored = quantize(tensor, "int8" if name == "lm_head.weight" else kind,
                                       torch.float32)
                assert torch.allclose(dequantize(q, tensor.shape[1]), restored, atol=1e-6)
                tensors[name] = restored.to(tensor.dtype)
        save_file(tensors, path, metadata={"format": "pt"})
    return out_dir


@pytest.mark.parametrize("kind", QUANTIZE_KINDS)
def test_quantized_model_equals_transformers_on_the_weights_it_stands_for(tmp_path, kind,
                                                                          monkeypatch):
    import transformers

    # float32 kernels: exact up to summation order (the bf16 ones served round the activations);
    # the kernels run for decode rows on any CPU, not only where they pay
    monkeypatch.setattr(linear_module, "QUANTIZED_KERNEL_DTYPE", torch.float32)
    monkeypatch.setattr(linear_module, "quantized_kernel_rows", lambda: 4)
    model_dir = build_tiny_model(tmp_path / "model", num_heads=4, num_kv_heads=2,
                                 attention_bias=True)
    loaded = load_model(model_dir, dtype=torch.float32, device=torch.device("cpu"),
                        parallel=ParallelContext(), quantize=kind)
    layers = [m.prepared for m in loaded.model.layers.modules() if hasattr(m, "prepared")]
    assert layers and all(p.quantized is not None and p.quantized.kind == kind for p in layers)
    # an int4 model keeps an int8 head
    assert loaded.model.lm_head.prepared.quantized.kind == "int8"
    cfg = loaded.config
    runner = ModelRunner(loaded.model, KVCacheSpec(cfg.num_hidden_layers, cfg.num_key_value_heads,
                                                   cfg.head_dim, 4, torch.float32,
                                                   torch.device("cpu")))
    runner.allocate(32)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        _dequantized_copy(model_dir, tmp_path / "dequantized", kind), dtype=torch.float32).eval()
    plain = transformers.AutoModelForCausalLM.from_pretrained(model_dir,
                                                              dtype=torch.float32).eval()
    # the prompt's 8 rows multiply by the weights the quantized forms stand for, each decode
    # row by the quantized kernels themselves: both must be that model
    prompt = [5, 17, 42, 99, 3, 250, 7, 11]
    assert len(prompt) > linear_module.quantized_kernel_rows()
    logits = runner.prefill([PrefillSequence(prompt, 0, [3, 1, 4])], all_logits_rows={0}).full[0]
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0]
        unquantized = plain(torch.tensor([prompt])).logits[0]
    assert (logits - expected).abs().max().item() <= 1e-4
    tokens = list(prompt)
    for _ in range(3):
        tokens.append(int(logits[-1].argmax()))
        logits = runner.decode(torch.tensor(tokens[-1:]), torch.tensor([len(tokens) - 1]),
                               torch.tensor([[3, 1, 4]])).logits
        with torch.no_grad():
            assert (logits[0] - reference(torch.tensor([tokens])).logits[0, -1]).abs().max() <= 1e-4
    assert (expected - unquantized).abs().max().item() > 1e-3


def test_a_bf16_int4_model_through_our_kernel_is_the_model_its_4_bit_form_stands_for(tmp_path):
    """Where our C int4 kernel runs, a bf16 model's int4 layers hold its form (a float32 scale and
    minimum per 32 weights) alone: decode rows multiply by it, the prompt's rows (more than its
    tiles take) by the bf16 weights it stands for, unpacked on the fly (on AVX2 every row by the
    4-bit form, rounded to int8 first), and both are, within that rounding and bf16's,
    transformers on those weights."""
    import transformers

    if not linear_module.c_int4_runs():
        pytest.skip("the C int4 matmul needs AVX-512 BF16 or AVX2, and a C compiler")
    model_dir = build_tiny_model(tmp_path / "model", num_heads=4, num_kv_heads=2,
                                 attention_bias=True)
    loaded = load_model(model_dir, dtype=torch.bfloat16, device=torch.device("cpu"),
                        parallel=ParallelContext(), quantize="int4")
    layers = [m.prepared for m in loaded.model.layers.modules() if hasattr(m, "prepared")]
    assert layers and all(p.quantized.kernel == "c" for p in layers)
    reference_dir = tmp_path / "restored"
    shutil.copytree(model_dir, reference_dir)
    for path in reference_dir.glob("*.safetensors"):
        tensors = load_file(path)
        for name, tensor in tensors.items():
            if tensor.dim() == 2 and name.endswith("proj.weight"):
                tensors[name] = int4_matmul.restore(*int4_matmul.quantize(tensor)).bfloat16()
            elif name == "lm_head.weight":  # an int8 head, its bf16 scales
                tensors[name] = quantize(tensor, "int8", torch.bfloat16)[1].bfloat16()
        save_file(tensors, path, metadata={"format": "pt"})
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        reference_dir, dtype=torch.bfloat16).float().eval()
    cfg = loaded.config
    runner = ModelRunner(loaded.model, KVCacheSpec(cfg.num_hidden_layers, cfg.num_key_value_heads,
                                                   cfg.head_dim, 4, torch.bfloat16,
                                                   torch.device("cpu")))
    runner.allocate(32)
    # more rows than the 4-bit tiles take: the prompt multiplies by unpacked blocks (on AVX2, by
    # the tiles: they take every batch)
    prompt = [5, 17, 42, 99, 3, 250, 7, 11, 60, 61] * ((int4_matmul.tile_rows() or 30) // 10 + 1)
    table = list(range(31, 31 - (len(prompt) + 3) // 4 - 1, -1))
    logits = runner.prefill([PrefillSequence(prompt, 0, table)]).last
    plain = transformers.AutoModelForCausalLM.from_pretrained(model_dir,
                                                              dtype=torch.float32).eval()
    tokens = list(prompt)
    for _ in range(3):
        with torch.no_grad():
            expected = reference(torch.tensor([tokens])).logits[0, -1]
            unquantized = plain(torch.tensor([tokens])).logits[0, -1]
        # bf16 rounding leaves 0.4-0.5% here; the unquantized model is over 1% away
        tolerance = 0.008 * expected.abs().max().item()
        assert (logits[0] - expected).abs().max().item() <= tolerance
        assert (unquantized - expected).abs().max().item() > tolerance
        tokens.append(int(logits[0].argmax()))
        logits = runner.decode(torch.tensor(tokens[-1:]), torch.tensor([len(tokens) - 1]),
                               torch.tensor([table])).logits


@pytest.mark.parametrize("kind", QUANTIZE_KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantization_error_is_within_half_a_step(kind, dtype):
    torch.manual_seed(0)
    weight = torch.randn(48, 96) * 0.05
    q, restored = quantize(weight, kind, dtype)
    torch.testing.assert_close(dequantize(q, 96), restored, rtol=0,
                               atol=1e-6 if dtype == torch.float32 else 2e-3)
    if kind == "int8":
        step = weight.abs().amax(dim=1, keepdim=True) / 127
    else:
        groups = weight.view(48, 3, 32)
        step = ((groups.amax(-1) - groups.amin(-1)) / 15).repeat_interleave(32, dim=1)
    # half a step, plus the rounding of the scales to `dtype`
    slack = 1e-6 if dtype == torch.float32 else 4e-3 * weight.abs().amax()
    assert ((restored - weight).abs() <= step / 2 + slack).all()
    x = torch.randn(5, 96)
    tolerance = 1e-5 if dtype == torch.float32 else 0.05
    torch.testing.assert_close(quantized_linear(x, q), x @ restored.T, rtol=0, atol=tolerance)


def test_shapes_the_kernels_cannot_take_stay_unquantized():
    from shard.layers.quantize import can_quantize

    # the int8 kernel reads past rows of 40 input features (wrong values, or a crash)
    assert not can_quantize(torch.zeros(16, 40), "int8")
    assert can_quantize(torch.zeros(16, 64), "int8") and can_quantize(torch.zeros(16, 64), "int4")
    assert not can_quantize(torch.zeros(8, 64), "int4")  # output features in tiles of 16
    prepared = linear_module.LinearWeight.prepare(torch.randn(16, 40), quantize_kind="int8")
    assert prepared.quantized is None
    x = torch.randn(2, 40)
    torch.testing.assert_close(linear_module.linear(x, prepared), x @ prepared.weight.T)


def test_quantize_is_refused_off_the_cpu_and_for_unknown_kinds():
    from launcher.config import LauncherConfig
    from shard.config import ShardConfig

    with pytest.raises(ValueError, match="--quantize int8 runs CPU kernels only"):
        LauncherConfig(quantize="int8", device="cuda")
    with pytest.raises(ValueError, match="is not one of"):
        LauncherConfig(quantize="eetq")
    with pytest.raises(ValueError, match="is not one of"):
        ShardConfig(model_path="x", quantize="nf4")


@pytest.mark.parametrize("kind", QUANTIZE_KINDS)
def test_served_kernels_stay_within_bf16_rounding_of_the_exact_ones(tmp_path, kind):
    """What the server runs (bf16 activations into the kernels) against the float32 kernels."""
    model_dir = build_tiny_model(tmp_path / "model", num_heads=4, num_kv_heads=2)
    prompt = [5, 17, 42, 99, 3, 250, 7, 11]
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(linear_module, "QUANTIZED_KERNEL_DTYPE", dtype)
            patch.setattr(linear_module, "quantized_kernel_rows", lambda: 16)
            loaded = load_model(model_dir, dtype=torch.float32, device=torch.device("cpu"),
                                parallel=ParallelContext(), quantize=kind)
        cfg = loaded.config
        runner = ModelRunner(loaded.model, KVCacheSpec(cfg.num_hidden_layers,
                                                       cfg.num_key_value_heads, cfg.head_dim, 4,
                                                       torch.float32, torch.device("cpu")))
        runner.allocate(32)
        out[dtype] = runner.prefill([PrefillSequence(prompt, 0, [3, 1])],
                                    all_logits_rows={0}).full[0]
    assert (out[torch.bfloat16] - out[torch.float32]).abs().max().item() <= 0.05


def test_the_kernels_run_only_where_they_pay(monkeypatch):
    torch.manual_seed(0)
    weight = torch.randn(32, 64, dtype=torch.bfloat16)
    # AVX-512 / AVX-NE-CONVERT without the C bf16 matmul; with it (AVX-512 BF16); AVX2 alone
    for has_bf16, c_matmul, rows in ((True, False, linear_module.QUANTIZED_MAX_ROWS),
                                     (True, True, 0), (False, False, 0)):
        monkeypatch.setattr(linear_module, "cpu_has_bf16_kernels", lambda: has_bf16)
        monkeypatch.setattr(linear_module, "c_matmul_runs", lambda: c_matmul)
        prepared = linear_module.LinearWeight.prepare(weight, quantize_kind="int8",
                                                      model_dtype=torch.float32)
        assert prepared.quantized is not None and prepared.quantized_rows == rows
        # a form no batch multiplies by is not held
        assert (prepared.quantized.data is not None) == (rows > 0)
