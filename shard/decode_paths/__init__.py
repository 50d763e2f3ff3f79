"""The decode step run other than eagerly: in one C call, compiled, or from CUDA graphs.

`c_step` runs a model's whole step in C from what its family declares (shard.models.decode_layout);
`compiled` wraps the eager step in torch.compile; `cuda_graphs` replays captured steps. The model
runner (shard.model_runner) chooses among them; the kernels they call live in shard.kernels.
"""
