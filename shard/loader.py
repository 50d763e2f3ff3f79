"""Loads a model directory: config, weights for this rank, tokenizer and end-of-sequence ids."""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers import Tokenizer

from shard.distributed import ParallelContext
from shard.layers.int8_dynamic import encoder_quantize
from shard.models import architecture_of, load_model_class
from shard.partition import RankHeads, split_heads
from shard.quant_config import checkpoint_quant
from shard.weights import Weights


@dataclass(slots=True)
class LoadedModel:
    model: torch.nn.Module
    config: object
    heads: RankHeads  # this rank's share of the attention heads
    tokenizer: Tokenizer
    eos_token_ids: frozenset[int]
    special_token_ids: frozenset[int]
    architecture: str  # the config.json architecture served, e.g. "LlamaForCausalLM"
    # config.json's, where the checkpoint is quantized (a native GGUF: its types)
    quantization_config: dict = field(default_factory=dict)
    # a vision-language model's: an image file -> pixel values for its tower; None: text only
    image_preprocessor: Callable[[bytes], torch.Tensor] | None = None


def load_model(model_dir: Path, *, dtype: torch.dtype, device: torch.device,
               parallel: ParallelContext, quantize: str | None = None,
               rope_scaling: dict | None = None) -> LoadedModel:
    """`rope_scaling` (the launcher's --rope-scaling/--rope-factor) replaces the checkpoint's."""
    model_dir = Path(model_dir)
    raw_config = json.loads((model_dir / "config.json").read_text())
    if rope_scaling is not None:
        raw_config = with_rope_scaling(raw_config, rope_scaling)
    model_class, config = load_model_class(raw_config)
    if getattr(model_class, "is_encoder", False):  # its int8 rounds activations too
        quantize = encoder_quantize(quantize)
    heads = split_heads(config.num_attention_heads, config.num_key_value_heads,
                        parallel.world_size)
    weights = Weights(model_dir, dtype=dtype, device=device, parallel=parallel, quantize=quantize,
                      checkpoint_quant=checkpoint_quant(raw_config))
    model = model_class(config, heads, weights).eval()
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    special = frozenset(i for i, tok in tokenizer.get_added_tokens_decoder().items() if tok.special)
    preprocessor = (model.image_preprocessor(model_dir)
                    if getattr(model, "image_tokens", None) is not None else None)
    return LoadedModel(model, config, heads, tokenizer, eos_token_ids(model_dir, raw_config, tokenizer),
                       special, architecture_of(raw_config),
                       raw_config.get("quantization_config") or {}, preprocessor)


def with_rope_scaling(config: dict, scaling: dict) -> dict:
    """config.json as if it had been saved with `scaling` ({"rope_type": "linear", "factor": f}).

    The context grows by the factor: a linear scaling of f maps f times as many positions onto
    the angles the model was trained on, and the rotary table covers max_position_embeddings."""
    config = {**config, "rope_scaling": dict(scaling)}
    if isinstance(config.get("rope_parameters"), dict):  # transformers 5's home for it
        config["rope_parameters"] = {**config["rope_parameters"], **scaling}
    factor = float(scaling.get("factor", 1.0))
    if factor > 1 and config.get("max_position_embeddings"):
        config["max_position_embeddings"] = int(config["max_position_embeddings"] * factor)
    return config


def eos_token_ids(model_dir: Path, config: dict, tokenizer: Tokenizer) -> frozenset[int]:
    """End-of-sequence ids from config.json, generation_config.json and the tokenizer's eos token."""
    ids: set[int] = set()

    def add(value):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))

    add(config.get("eos_token_id"))
    generation = model_dir / "generation_config.json"
    if generation.exists():
        add(json.loads(generation.read_text()).get("eos_token_id"))
    tokenizer_config = model_dir / "tokenizer_config.json"
    if tokenizer_config.exists():
        eos = json.loads(tokenizer_config.read_text()).get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str) and tokenizer.token_to_id(eos) is not None:
            ids.add(tokenizer.token_to_id(eos))
    return frozenset(ids)
