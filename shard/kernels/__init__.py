"""Our C kernels (the .c and .h files here), built for this CPU on first use, and their Python glue.

The glue calls the bf16 and int4 matmuls, paged decode attention, fused layer ops and LoRA updates;
decode_step.c, the whole decode step in C, is called from shard.decode_paths.c_step.
"""
