"""The dtype of a shard started without --dtype: chosen once its device is known, and reported."""
import json

import pytest

from shard import config as shard_config
from shard.config import ShardConfig, default_dtype, parse_args

AVX2 = "flags\t\t: fpu vme sse4_2 avx f16c avx2 fma bmi2"
AVX512 = AVX2 + " avx512f avx512bw avx512_bf16"
NO_AVX2 = "flags\t\t: fpu vme sse4_2 avx"


@pytest.mark.parametrize("flags, expected", [(AVX2, "bfloat16"), (AVX512, "bfloat16"),
                                             (NO_AVX2, "float32"), ("", "float32")],
                         ids=["avx2", "avx512", "avx-only", "non-x86"])
def test_the_cpu_default_is_bf16_where_the_cpu_has_avx2(monkeypatch, tmp_path, flags, expected):
    monkeypatch.setattr(shard_config, "cpu_flags", lambda: flags)
    assert default_dtype("cpu", tmp_path) == expected  # no config.json read on the CPU


def test_an_encoder_on_the_cpu_defaults_to_float32(monkeypatch, tmp_path):
    """BERT only runs prompt-sized matmuls, where bf16 is no faster (and float32 is exact)."""
    monkeypatch.setattr(shard_config, "cpu_flags", lambda: AVX512)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    assert default_dtype("cpu", tmp_path) == "float32"
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert default_dtype("cpu", tmp_path) == "bfloat16"


@pytest.mark.parametrize("stored, expected", [({"torch_dtype": "bfloat16"}, "bfloat16"),
                                              ({"dtype": "bfloat16"}, "bfloat16"),
                                              ({"torch_dtype": "float32"}, "float16"),
                                              ({"torch_dtype": "float16"}, "float16"),
                                              ({}, "float16")])
def test_the_cuda_default_is_float16_unless_the_checkpoint_is_bf16(tmp_path, stored, expected):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **stored}))
    assert default_dtype("cuda", tmp_path) == expected


def test_no_dtype_flag_leaves_the_choice_to_the_shard():
    assert parse_args(["--model-path", "m"]).dtype == ""
    assert parse_args(["--model-path", "m", "--dtype", "float32"]).dtype == "float32"
    with pytest.raises(ValueError, match="is not one of"):
        ShardConfig(model_path="m", dtype="int8")


@pytest.mark.parametrize("flags, given, expected", [(AVX512, "", "bfloat16"),
                                                    (NO_AVX2, "", "float32"),
                                                    (AVX512, "float32", "float32")],
                         ids=["default-avx512", "default-no-avx2", "explicit-float32"])
def test_the_engine_loads_and_reports_the_resolved_dtype(monkeypatch, tiny_llama, flags, given,
                                                         expected):
    import torch

    from shard.__main__ import build_engine

    monkeypatch.setattr(shard_config, "cpu_flags", lambda: flags)
    engine, _, info, _ = build_engine(ShardConfig(model_path=str(tiny_llama), dtype=given,
                                               device="cpu"))
    assert info.dtype == expected and info.device_type == "cpu"
    assert engine.runner.spec.dtype == getattr(torch, expected)  # the KV cache
    assert engine.runner.model.embed_tokens.weight.dtype == getattr(torch, expected)


@pytest.mark.parametrize("capability, expected", [((8, 0), "bfloat16"), ((9, 0), "bfloat16"),
                                                  ((7, 5), "float16")], ids=["a100", "h100", "t4"])
def test_a_gpu_without_bf16_takes_float16_for_a_bf16_checkpoint(monkeypatch, tmp_path,
                                                                capability, expected):
    import torch

    from shard.__main__ import _default_dtype
    from shard.distributed import ParallelContext

    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda device=None: asked.append(device) or capability)
    config = ShardConfig(model_path=str(tmp_path))
    assert _default_dtype(config, torch.device("cuda", 1), ParallelContext()) == expected
    assert asked == [torch.device("cuda", 1)], "the shard's own GPU is asked"
