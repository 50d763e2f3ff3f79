"""How a model's attention heads split over tensor-parallel ranks.

Torch-free on purpose: the launcher refuses a shard count before any process starts with the same
rule the shards apply when they load, and the model receives the per-rank counts ready-made.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RankHeads:
    """Heads one rank computes: each rank holds the same number of query and key/value heads."""

    num_heads: int
    num_kv_heads: int


def split_heads(num_heads: int, num_kv_heads: int, world_size: int) -> RankHeads:
    """The per-rank heads of a model split `world_size` ways; ValueError when it cannot split."""
    for name, count in (("attention heads", num_heads), ("key/value heads", num_kv_heads)):
        if count % world_size:
            raise ValueError(f"{world_size} shards do not divide the model's {count} {name}; use "
                             f"a shard count that divides both {num_heads} and {num_kv_heads}")
    return RankHeads(num_heads // world_size, num_kv_heads // world_size)


def split_heads_of(config: dict, world_size: int) -> RankHeads | None:
    """split_heads for a config.json (key/value heads default to the attention heads).

    A multimodal config's text model is its text_config, whose heads may be left to the family's
    defaults: None then, and the shard applies the rule once its model class has read them."""
    text = config.get("text_config") or config
    if "num_attention_heads" not in text and text is not config:
        return None
    heads = text["num_attention_heads"]
    return split_heads(heads, text.get("num_key_value_heads") or heads, world_size)
