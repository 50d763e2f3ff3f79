"""Talking to the shards: the gRPC clients and the contract's conversions.

Talking to the shards: the gRPC clients (one per rank, in lock-step) and the conversion between
the router's types and the shard contract's messages.
"""
