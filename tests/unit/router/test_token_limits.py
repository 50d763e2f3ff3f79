"""The token limits resolved at start from the flags, the model's context and the shards."""
import pytest

from router.config.model import ModelSettings
from router.inputs.validation import TokenLimits
from router.lifecycle.limits import CPU_PREFILL_TOKENS, resolve_limits
from router.shards.convert import ShardInfo


def _resolve(*, chunking=True, device_type="cpu", **settings) -> TokenLimits:
    info = ShardInfo(dtype="float32", device_type=device_type, world_size=1, block_size=16,
                     max_position_embeddings=8192, support_chunking=chunking,
                     use_prefix_caching=True, hidden_size=8)
    return resolve_limits(ModelSettings(tokenizer_path="/m", **settings), info)


def test_tgi_defaults_from_the_context():
    limits = _resolve(device_type="cuda")
    assert (limits.max_input_tokens, limits.max_total_tokens) == (4095, 4096)
    assert limits.max_batch_prefill_tokens == 4095 + 50  # TGI's: the longest prompt + 50


def test_chunking_cpu_shards_default_to_a_smaller_prefill_budget():
    """Prefill on a CPU is compute-bound from a few hundred tokens: a wave of prompts goes in
    budget-sized batches that start streaming in turn. Not where the shards cannot chunk (a
    prompt must fit one prefill), and never above TGI's default."""
    assert _resolve().max_batch_prefill_tokens == CPU_PREFILL_TOKENS
    assert _resolve(chunking=False).max_batch_prefill_tokens == 4145
    assert _resolve(max_input_tokens=100, max_total_tokens=200).max_batch_prefill_tokens == 150


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_the_flag_wins(device_type):
    assert _resolve(max_batch_prefill_tokens=4096,
                    device_type=device_type).max_batch_prefill_tokens == 4096
    assert _resolve(max_batch_prefill_tokens=64,
                    device_type=device_type).max_batch_prefill_tokens == 64


def test_a_budget_below_the_longest_prompt_needs_chunking_shards():
    with pytest.raises(ValueError, match="max_batch_prefill_tokens"):
        _resolve(chunking=False, max_batch_prefill_tokens=100)
