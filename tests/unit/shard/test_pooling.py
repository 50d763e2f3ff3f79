"""Reading a checkpoint's sentence-transformers pooling, and pooling hidden states by it."""
import json

import pytest
import torch

from shard.pooling import pool, read_pooling


def _write(tmp_path, pooling: dict | None, normalize: bool = False, bert: dict | None = None):
    modules = [{"type": "sentence_transformers.models.Transformer", "path": ""}]
    if pooling is not None:
        modules.append({"type": "sentence_transformers.models.Pooling", "path": "1_Pooling"})
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    if normalize:
        modules.append({"type": "sentence_transformers.models.Normalize", "path": "2_Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    if bert is not None:
        (tmp_path / "sentence_bert_config.json").write_text(json.dumps(bert))
    return tmp_path


def test_a_directory_without_sentence_transformers_files_is_mean_pooled_unnormalized(tmp_path):
    read = read_pooling(tmp_path, {"hidden_size": 8})
    assert (read.mode, read.normalize, read.declared, read.matryoshka) == ("mean", False, False,
                                                                           False)


@pytest.mark.parametrize("settings, mode", [
    ({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}, "mean"),  # legacy
    ({"pooling_mode_cls_token": True}, "cls"),
    ({"pooling_mode_lasttoken": True}, "last"),
    ({"pooling_mode": "lasttoken", "include_prompt": True}, "last"),
    ({"pooling_mode": ["max"]}, "max"),
    ({"pooling_mode": "weightedmean"}, ""),  # not served: the model cannot embed, and says why
    ({"pooling_mode": ["mean", "max"]}, ""),
    ({"pooling_mode": "mean", "include_prompt": False}, ""),
])
def test_the_pooling_module_names_the_mode(tmp_path, settings, mode):
    read = read_pooling(_write(tmp_path, settings, normalize=True, bert={"max_seq_length": 128}),
                        {"matryoshka_dimensions": [32, 64]})
    assert read.mode == mode and read.declared and read.normalize
    assert (mode == "") == bool(read.why_not)
    assert read.max_seq_length == 128 and read.matryoshka and read.matryoshka_dimensions == (32, 64)


def test_each_mode_pools_as_sentence_transformers_does():
    hidden = torch.tensor([[1.0, -2.0], [3.0, 4.0], [5.0, 0.0]])
    assert torch.allclose(pool(hidden, "mean"), torch.tensor([3.0, 2 / 3]))
    assert pool(hidden, "cls").tolist() == [1.0, -2.0]
    assert pool(hidden, "last").tolist() == [5.0, 0.0]
    assert pool(hidden, "max").tolist() == [5.0, 4.0]
    assert torch.allclose(pool(hidden, "mean_sqrt_len"), torch.tensor([9.0, 2.0]) / 3 ** 0.5)
    with pytest.raises(ValueError):
        pool(hidden, "weightedmean")
