"""Continuous batching: the queue, the policy, the batcher loop and its shard steps.

Also the running set and the KV blocks each request holds, failure fan-out, and recovery when the
shards restart.
"""
