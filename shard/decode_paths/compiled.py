"""The decode step compiled with torch.compile (inductor's C++ backend on the CPU) at warm-up.

Inductor fuses the thousands of small ops an eager step dispatches into a few loops per layer.
Where compiling is not possible or a step would need a new graph, the step runs eagerly and the
log says why.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch

log = logging.getLogger("tgi.shard.compiled_decode")

Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

# a block table narrower than this would be a size-1 dimension, which PyTorch compiles apart
MIN_TABLE_WIDTH = 2


def unsupported_reason(model: torch.nn.Module, device: torch.device, world_size: int) -> str | None:
    """Why the decode step of this model cannot be compiled here, or None."""
    if device.type != "cpu":
        return "only the CPU step is compiled (on CUDA the step replays CUDA graphs: --cuda-graphs)"
    if world_size > 1:
        return "tensor-parallel steps run their all-reduces eagerly"
    for module in model.modules():
        prepared = getattr(module, "prepared", None)
        if prepared is None:
            continue
        if prepared.quantized is not None:
            return "quantized layers choose their kernel by the number of rows"
        if prepared.widened is not None:
            return "bf16 weights on a CPU without bf16 kernels choose their kernel by rows"
    return None


def _configure_compiler() -> None:
    """Sets inductor up to call oneDNN's prepacked linear op as an external kernel.

    Inductor lowers mkldnn::_linear_pointwise (and fuses it with the adds around it) only for
    weights it prepacked itself in a frozen graph; ours are prepacked at load time and arrive as
    graph inputs, where the lowering fails."""
    from torch._inductor import lowering
    from torch._inductor.fx_passes import mkldnn_fusion

    op = torch.ops.mkldnn._linear_pointwise.default
    if lowering.lowerings.get(op) is not None and not getattr(op, "_tgi_fallback", False):
        lowering.lowerings.pop(op)
        lowering.make_fallback(op, warn=False)
        op._tgi_fallback = True
    mkldnn_fusion._mkldnn_fusion_init = lambda: None
    # sizes that happen to be equal when a graph is traced (a batch of 2, a table 2 blocks wide,
    # 2 KV heads) must not be assumed equal forever: that would take a new graph for each
    from torch.fx.experimental import _config as symbolic_shapes_config

    symbolic_shapes_config.use_duck_shape = False


class CompiledDecode:
    """A decode step function compiled once, used until a step would need another graph.

    Sizes are dynamic: one graph serves every batch of 2 rows or more and every context length,
    and one more a single row (PyTorch specialises sizes of 1), so the two compilations of `warm`
    cover every step and no request pays for one. What should not be compiled is called as it
    is: oneDNN's prepacked bf16 matmuls (_configure_compiler), our C bf16 matmul and C attention
    kernel (custom ops)."""

    def __init__(self, step: Step):
        _configure_compiler()
        self.eager = step
        self.compiled = torch.compile(step, dynamic=True)
        self.active = False  # set once warmed; cleared for good on the first failure

    def warm(self, tables_width: int) -> None:
        """Compiles the two graphs (one row; several rows) with a step over block 0.

        Block 0 never holds a request's keys. From then on a step that would need another graph
        raises (every guard is still checked) instead of compiling in the middle of serving."""
        width = max(tables_width, MIN_TABLE_WIDTH)
        torch.compiler.set_stance("default")  # a pool allocated again is warmed again
        self.active = False
        try:
            for rows in (1, 2, 3):
                ids = torch.zeros(rows, dtype=torch.long)
                lengths = torch.full((rows,), 1, dtype=torch.long)
                self.compiled(ids, lengths, torch.zeros(rows, width, dtype=torch.long))
        except Exception as err:  # no C++ compiler, an op inductor cannot take...
            log.warning("the decode step could not be compiled, it runs eagerly: %s",
                        str(err).strip().splitlines()[0][:300] if str(err).strip() else repr(err))
            return
        torch.compiler.set_stance("fail_on_recompile")
        self.active = True
        log.info("decode step compiled (one graph for a single row, one for larger batches)")

    def __call__(self, input_ids: torch.Tensor, seq_lens: torch.Tensor,
                 block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.active:
            return self.eager(input_ids, seq_lens, block_tables)
        if block_tables.shape[1] < MIN_TABLE_WIDTH:  # padded with block 0, as tables are
            block_tables = torch.nn.functional.pad(
                block_tables, (0, MIN_TABLE_WIDTH - block_tables.shape[1]))
        # the graphs were traced on inference tensors (made under inference mode, as this call
        # runs); a batch's own tensors may have been made outside it, which is another graph
        inputs = [t if t.is_inference() else t.clone()
                  for t in (input_ids, seq_lens, block_tables)]
        try:
            return self.compiled(*inputs)
        except Exception as err:
            self.active = False
            torch.compiler.set_stance("default")
            log.warning("the compiled decode step failed (%s); steps run eagerly from now on",
                        str(err).strip().splitlines()[0][:300] if str(err).strip() else repr(err))
            return self.eager(input_ids, seq_lens, block_tables)
