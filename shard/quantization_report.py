"""What a loaded model's weights are held in: a GGUF's types as served, or --quantize's form."""
from __future__ import annotations

from torch import nn

from shard.layers.embedding import VocabParallelEmbedding
from shard.layers.moe import SparseMoeBlock
from shard.quant_config import checkpoint_quant

# how a GGUF type's matrices are multiplied, as LinearWeight.form names it
_KERNELS = {"int4": "int4 kernel", "int8": "int8 kernel", "blocks": "dequantized per layer"}


def served_types(model: nn.Module) -> dict[str, dict[str, int]]:
    """Each GGUF type (or quantized checkpoint's kind) the model holds -> {how: how many layers}.

    Linear layers by their form (LinearWeight.form); a GGUF embedding as "embedding lookup".
    A checkpoint's kind is its parts' (shard/layers/checkpoint_formats.py), e.g. GPTQ-4bit-g128.
    A rank holds 1/world_size of each MoE block's experts, stored alike (one GGUF stack, one
    checkpoint's scheme): its experts' layers count for every rank's, the model's whole."""
    served: dict[str, dict[str, int]] = {}
    ranks = {id(layer): block.parallel.world_size for block in model.modules()
             if isinstance(block, SparseMoeBlock) for layer in block.experts.modules()}
    for module in model.modules():
        prepared = getattr(module, "prepared", None)
        kinds = getattr(prepared, "block_kinds", ())
        for kind in kinds:
            how = _KERNELS.get(prepared.form, prepared.form)
            served.setdefault(kind, {}).setdefault(how, 0)
            served[kind][how] += ranks.get(id(module), 1)
        if isinstance(module, VocabParallelEmbedding):
            for kind in module.kinds:
                served.setdefault(kind, {}).setdefault("embedding lookup", 0)
                served[kind]["embedding lookup"] += 1
    return served


def describe(model: nn.Module, quantization: dict, quantize: str | None) -> str:
    """One line for /info and the log: "" where the weights are the model's dtype.

    A native GGUF: "gguf Q4_K_M: Q4_K in 100 layers (int4 kernel), Q6_K in 29 (int8 kernel),
    ..." (a fused projection counts once per type in it); the types the conversion dequantized
    follow; a quantized checkpoint: "gptq 4-bit g128: 112 layers (int4 kernel)"; --quantize:
    its kind."""
    if quantize:
        return f"{quantize} (--quantize)"
    served = served_types(model)
    if not served:
        return ""
    quant = checkpoint_quant({"quantization_config": quantization})
    if quant is not None:
        return f"{quant.summary()}: " + ", ".join(
            f"{'' if len(served) == 1 else kind + ' in '}{count} "
            f"{'layer' if count == 1 else 'layers'} ({how})"
            for kind, forms in sorted(served.items()) for how, count in sorted(forms.items()))
    parts = [f"{kind} in {count} {'layer' if count == 1 else 'layers'} ({how})"
             for kind, forms in sorted(served.items()) for how, count in sorted(forms.items())]
    dequantized = quantization.get("dequantized") or {}
    if dequantized:
        parts.append("dequantized to float: " + ", ".join(
            f"{kind} x {count} tensors" for kind, count in sorted(dequantized.items())))
    file_type = quantization.get("file_type")
    return f"gguf{' ' + file_type if file_type else ''}: " + ", ".join(parts)
