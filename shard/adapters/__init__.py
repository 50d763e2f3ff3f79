"""LoRA adapters on the shard: PEFT's files (peft_files), the set loaded on a model (adapter_set).

PEFT's files are read and checked against the model, off the engine thread, their rank_pattern
and alpha_pattern keys matched in bounded time (module_patterns, linear_regex); the set loaded
on a model holds one slot per adapter, whose updates its linear layers add row by row (the
arithmetic is shard/layers/lora.py)."""
