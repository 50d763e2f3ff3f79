"""The one rule for splitting heads over ranks, shared by the launcher and the shards."""
import subprocess
import sys

import pytest

from shard.partition import RankHeads, split_heads, split_heads_of


def test_heads_split_evenly_or_not_at_all():
    assert split_heads(9, 3, 3) == RankHeads(3, 1)
    assert split_heads(32, 8, 1) == RankHeads(32, 8)
    with pytest.raises(ValueError, match="2 shards do not divide the model's 9 attention heads"):
        split_heads(9, 3, 2)
    with pytest.raises(ValueError, match="4 shards do not divide the model's 2 key/value heads"):
        split_heads(8, 2, 4)


def test_a_config_without_key_value_heads_has_as_many_as_attention_heads():
    assert split_heads_of({"num_attention_heads": 4}, 2) == RankHeads(2, 2)
    assert split_heads_of({"num_attention_heads": 4, "num_key_value_heads": None}, 4) == \
        RankHeads(1, 1)


def test_the_launcher_can_use_it_without_importing_torch():
    code = "import sys, shard.partition; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_a_multimodal_config_splits_its_text_models_heads():
    config = {"text_config": {"num_attention_heads": 8, "num_key_value_heads": 4}}
    assert split_heads_of(config, 2) == RankHeads(4, 2)
    with pytest.raises(ValueError):
        split_heads_of(config, 3)
    # heads left to the family's defaults: the shard checks once its config class has read them
    assert split_heads_of({"text_config": {"hidden_size": 2560}}, 2) is None
