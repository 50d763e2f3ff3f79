"""Talking to the shards: the gRPC clients and the contract's conversions.

One client per rank, in lock-step; the conversions are between the router's types and the shard
contract's messages.
"""
