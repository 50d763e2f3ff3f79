"""The decode step replayed from CUDA graphs, one captured per batch-size and table-width bucket.

For a small batch a step's few hundred kernel launches, not its arithmetic, set its time, and a
replay is one launch. A step no graph holds runs eagerly.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger("tgi.shard.cuda_graphs")

Outputs = tuple[torch.Tensor, torch.Tensor]  # logits [B, vocab], hidden states [B, hidden]
# (input_ids, seq_lens, block_tables, the positions the rows are rotated at) -> outputs
Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], Outputs]
# (step, its input buffers) -> (its output buffers, a function that recomputes them in place
# from whatever the input buffers hold then)
Capture = Callable[[Step, tuple[torch.Tensor, ...]], tuple[Outputs, Callable[[], None]]]

# A graph's attention gathers every row's keys and values over the graph's whole width, in memory
# left beside the KV pool (a tenth of the free memory on CUDA); buckets that would gather more
# than this a layer are not captured, and their steps run eagerly, grouping rows by length.
MAX_GATHER_BYTES = 512 << 20


def width_buckets(max_width: int) -> list[int]:
    """Block-table widths to capture: powers of two below max_width, then max_width."""
    widths, width = [], 1
    while width < max_width:
        widths.append(width)
        width *= 2
    return widths + [max(max_width, 1)]


class CudaGraphCapture:
    """Records steps as CUDA graphs on `device`, all in one memory pool of their own.

    The graphs never replay at once, so their activations can share memory. Each graph's outputs
    stay allocated (live tensors, which no later capture reuses), but its next replay writes them
    again: that is why a replay's results are copied before the next replay."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, step: Step, inputs: tuple[torch.Tensor, ...]
                 ) -> tuple[Outputs, Callable[[], None]]:
        with torch.cuda.device(self.device):
            # a first run on a side stream, as PyTorch asks: lazy initialisations (cuBLAS
            # handles, workspaces) must not happen inside the capture
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step(*inputs)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: the server's Health probe may allocate on another thread meanwhile
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                outputs = step(*inputs)
        return outputs, graph.replay


@dataclass(slots=True)
class CapturedStep:
    input_ids: torch.Tensor  # [rows]
    seq_lens: torch.Tensor  # [rows]
    block_tables: torch.Tensor  # [rows, width]
    positions: torch.Tensor  # [rows]: seq_lens, or multimodal rotary positions
    logits: torch.Tensor  # [rows, vocab]: written by each replay
    hidden: torch.Tensor  # [rows, hidden]
    replay: Callable[[], None]


class GraphedDecode:
    """Decode steps replayed from graphs captured for each (batch size, table width) bucket.

    A graph replays fixed shapes and fixed addresses, so each one owns its input buffers: a step
    copies its rows into the smallest graph that holds them, pads the rest (rows that write into
    block 0, which no request holds, and read one token; table columns that name block 0 and are
    masked), replays, and reads its rows back. Buckets are TGI's batch sizes (`--cuda-graphs`)
    times table widths in powers of two up to the longest request (`--max-total-tokens`): the
    attention reads every column of its graph's width, so one graph as wide as the longest
    request would make every step pay for it."""

    def __init__(self, step: Step, batch_sizes: list[int], device: torch.device, *,
                 block_bytes: int, new_capture: Callable[[torch.device], Capture] = CudaGraphCapture):
        """Steps of `step` for `batch_sizes` rows, captured on `device` by `new_capture`.

        block_bytes: the keys and values of one KV block of one layer, which a step gathers per
        row and table column; 0 when the step's attention gathers nothing (Triton's kernel).
        new_capture: how a graph is captured; tests on the CPU pass one that replays the function
        on the same buffers, which holds this class to the contract a CUDA graph imposes."""
        self.step = step
        self.batch_sizes = sorted(batch_sizes)
        self.device = device
        self.block_bytes = block_bytes
        self.new_capture = new_capture
        self.widths: list[int] = []
        self.graphs: dict[tuple[int, int], CapturedStep] = {}

    def capture(self, max_width: int) -> None:
        """Captures the buckets for tables up to max_width blocks (the longest request's).

        Largest first, so the pool is sized once by the largest; a bucket whose attention would
        gather more than MAX_GATHER_BYTES a layer is left to eager steps. The steps captured
        write into block 0 only. On failure no graph is kept and the error is raised."""
        self.release()
        capture = self.new_capture(self.device)
        # a kernel reading each row's context in place (block_bytes 0) costs the same at any
        # table width: one width, the longest request's, serves every step
        widths = width_buckets(max_width) if self.block_bytes else [max(max_width, 1)]
        try:
            for rows in reversed(self.batch_sizes):
                for width in reversed(widths):
                    if rows * width * self.block_bytes > MAX_GATHER_BYTES:
                        continue
                    inputs = (torch.zeros(rows, dtype=torch.long, device=self.device),
                              torch.zeros(rows, dtype=torch.long, device=self.device),
                              torch.zeros(rows, width, dtype=torch.long, device=self.device),
                              torch.zeros(rows, dtype=torch.long, device=self.device))
                    (logits, hidden), replay = capture(self.step, inputs)
                    self.graphs[rows, width] = CapturedStep(*inputs, logits, hidden, replay)
        except BaseException:
            self.release()
            raise
        self.widths = widths
        log.info("decode step captured in %d CUDA graphs (batch sizes %s, table widths %s "
                 "blocks; %d buckets over %d MiB of keys and values a layer left to eager "
                 "steps)", len(self.graphs), ",".join(map(str, self.batch_sizes)),
                 ",".join(map(str, widths)),
                 len(self.batch_sizes) * len(widths) - len(self.graphs), MAX_GATHER_BYTES >> 20)

    @property
    def captured(self) -> bool:
        return bool(self.graphs)

    def release(self) -> None:
        """Drops every graph (they read and write the KV pool they were captured over)."""
        self.graphs = {}
        self.widths = []

    def bucket(self, rows: int, width: int) -> CapturedStep | None:
        """The smallest graph holding `rows` rows of `width` table columns, or None."""
        fits_rows = [b for b in self.batch_sizes if b >= rows]
        fits_width = [w for w in self.widths if w >= width]
        if not fits_rows or not fits_width:
            return None
        return self.graphs.get((fits_rows[0], fits_width[0]))

    def __call__(self, input_ids: torch.Tensor, seq_lens: torch.Tensor,
                 block_tables: torch.Tensor, width: int,
                 positions: torch.Tensor | None = None) -> Outputs | None:
        """One step of these rows from a graph, or None when none holds it (then run eagerly).

        It reads `width` columns of their tables, enough to cover every context; the rows are
        rotated at `positions` where given (multimodal rotary ones), else at seq_lens."""
        rows = input_ids.shape[0]
        graph = self.bucket(rows, width)
        if graph is None:
            return None
        # every row past the batch reads block 0's first token and writes it back (padding); a
        # previous, larger step left its rows there
        graph.input_ids.zero_()
        graph.seq_lens.zero_()
        graph.block_tables.zero_()
        graph.positions.zero_()
        graph.input_ids[:rows].copy_(input_ids)
        graph.seq_lens[:rows].copy_(seq_lens)
        graph.positions[:rows].copy_(seq_lens if positions is None else positions)
        width = min(width, block_tables.shape[1])
        graph.block_tables[:rows, :width].copy_(block_tables[:, :width])
        graph.replay()
        # the next replay overwrites the buffers: the step's results are copies
        return graph.logits[:rows].clone(), graph.hidden[:rows].clone()
