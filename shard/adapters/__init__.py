"""LoRA adapters on the shard: PEFT's files read and checked against the model (peft_files), and
the set loaded on a model, one slot each, whose updates its linear layers add row by row
(adapter_set; the arithmetic is shard/layers/lora.py)."""
