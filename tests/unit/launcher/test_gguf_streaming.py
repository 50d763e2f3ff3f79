"""Converting a GGUF holds a slice of one tensor at a time, not the model: a fresh process converts
a synthetic Llama of a few hundred MB (float32, float16, Q8_0, Q5_0, Q4_K and Q6_K tensors) while
its peak resident memory is watched, and every value written is the GGUF's rounded to bfloat16."""
import gguf
import numpy as np
import torch
from safetensors import safe_open

from benchmarks.gguf_convert import Shape, measure_conversion, write_synthetic_gguf
from launcher.gguf import hf_tensor_name
from launcher.gguf_architectures import ARCHITECTURES
from tests.unit.launcher.tiny_gguf import permute_like_llama_cpp

# the embedding (64 MB in float32) is the largest tensor; the model is ten times that
SHAPE = Shape(hidden=1024, heads=8, kv_heads=4, ffn=4096, vocab=16384, layers=8)


def test_peak_memory_is_a_slice_of_a_tensor_and_the_values_are_the_ggufs(tmp_path):
    path = tmp_path / "synthetic.gguf"
    made = write_synthetic_gguf(path, SHAPE, "mixed")
    assert set(made["types"].values()) == {"F32", "F16", "Q8_0", "Q5_0", "Q4_K", "Q6_K"}
    largest, model = made["largest_tensor_float32_bytes"], 4 * made["parameters"]
    assert model > 8 * largest

    figures = measure_conversion(path, tmp_path / "out", weights_only=True)
    grown = (figures["peak_kib"] - figures["baseline_kib"]) * 1024
    # the converter used to hold the whole float32 model before saving it; even one whole tensor
    # at a time, with dequantisation's temporaries, goes over this
    assert grown < 2 * largest, figures
    assert figures["output_files"] == ["config.json", "generation_config.json",
                                       "model.safetensors"]

    heads = {"attn_q": SHAPE.heads, "attn_k": SHAPE.kv_heads}
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as converted:
        for tensor in gguf.GGUFReader(str(path)).tensors:
            # the whole tensor at once, by gguf-py's own reader: not the converter's slices
            stored = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            stored = np.array(stored, dtype=np.float32).reshape(
                [int(d) for d in reversed(tensor.shape)])
            ours = converted.get_tensor(hf_tensor_name(tensor.name, ARCHITECTURES["llama"]))
            assert ours.dtype == torch.bfloat16
            kind = tensor.name.split(".")[-2]
            if kind in heads:  # llama.cpp's interleaved rope rows, undone
                ours = torch.from_numpy(permute_like_llama_cpp(ours.float().numpy(),
                                                               heads[kind])).bfloat16()
            assert torch.equal(ours, torch.from_numpy(stored).to(torch.bfloat16)), tensor.name
