"""The launcher refuses a model it cannot split or read before any process starts."""
import json

import pytest

from launcher.shard_group import LaunchError
from launcher.supervisor import check_shardable


def test_a_config_of_another_shape_is_a_launch_error_not_a_crash(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(LaunchError, match="does not describe a model this server serves"):
        check_shardable(tmp_path, 1)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(LaunchError, match="does not describe a model"):
        check_shardable(tmp_path, 1)
