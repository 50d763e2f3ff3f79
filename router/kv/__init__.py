"""The router's side of the paged KV cache: which blocks each request uses.

The block pool and allocator, the prefix cache and request_id sessions; the shards own the memory.
"""
