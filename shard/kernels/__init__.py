"""Our C kernels (the .c and .h files here), built for this CPU on first use, and their Python glue.

The kernels: the bf16 and int4 matmuls, paged decode attention, fused layer ops, the whole decode
step in C, and the decode step compiled (torch.compile) or replayed (CUDA graphs)."""
