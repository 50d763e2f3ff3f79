"""Continuous batching: the waiting queue, the policy that picks the next prefill, the batcher loop
and its shard steps, the running set and the KV blocks each request holds, failure fan-out, and
recovery when the shards restart."""
