"""The router's side of the paged KV cache: the block allocator, the prefix cache and request_id
sessions (the shards own the memory; the router decides which blocks each request uses)."""
