"""The decode step replayed from CUDA graphs, one captured per batch-size and table-width bucket.

For a small batch a step's few hundred kernel launches, not its arithmetic, set its time, and a
replay is one launch. A step no graph holds runs eagerly.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shard.config import AUTO_CUDA_GRAPHS

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
# Without --cuda-graphs, graphs go up to the largest decode batch the router may form, and no
# further than vLLM's default max_num_seqs
MAX_AUTO_BATCH = 256


def largest_decode_batch(num_blocks: int, max_batch_size: int | None, ranks: int = 1) -> int:
    """The most rows a decode step may have: --max-batch-size, else what the KV pool holds.

    Every request holds a block at least, and block 0 is never handed out; at most
    MAX_AUTO_BATCH either way. With several ranks the pool is not asked: each rank sizes its
    own, and ranks whose graphs differ would pair their collectives wrongly."""
    pool_rows = max(num_blocks - 1, 1) if ranks == 1 else MAX_AUTO_BATCH
    return min(max_batch_size or pool_rows, pool_rows, MAX_AUTO_BATCH)


def auto_batch_sizes(largest: int, *, gathers: bool) -> list[int]:
    """The batch sizes captured without --cuda-graphs: those below `largest`, then `largest`.

    Attention reading the cache in place (one graph width): 1, 2, 4, then every 8 (vLLM's
    spacing), so that a step computes at most 7 padding rows, where TGI's powers of two would
    have a step of 130 rows compute 256. Attention that gathers each context, which is captured
    at several widths too: powers of two (TGI's spacing), which keep the graphs few."""
    if gathers:
        below = [1 << i for i in range(largest.bit_length()) if 1 << i < largest]
    else:
        below = [size for size in (1, 2, 4, *range(8, largest, 8)) if size < largest]
    return below + [largest]


def width_buckets(max_width: int) -> list[int]:
    """Block-table widths to capture: powers of two below max_width, then max_width."""
    widths, width = [], 1
    while width < max_width:
        widths.append(width)
        width *= 2
    return widths + [max(max_width, 1)]


class CudaGraphCapture:
    """Records steps as CUDA graphs on `device`, all in one memory pool of their own.

    The graphs never replay at once, so their activations can share memory. The outputs a graph
    writes stay allocated (live tensors, which no later capture reuses; GraphedDecode has every
    graph write into the same ones), but the next replay writes them again: that is why a
    replay's results are copied before the next replay."""

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
    masked), replays, and reads its rows back. Buckets are the batch sizes (`--cuda-graphs`, or
    auto_batch_sizes) times table widths in powers of two up to the longest request
    (`--max-total-tokens`): attention that gathers reads every column of its graph's width, so
    one graph as wide as the longest request would make every step pay for it. All graphs
    write their results into the largest one's output buffers: one batch's logits in memory,
    not one per graph."""

    def __init__(self, step: Step, batch_sizes: list[int] | str, device: torch.device, *,
                 block_bytes: int, block_size: int = 1,
                 new_capture: Callable[[torch.device], Capture] = CudaGraphCapture):
        """Steps of `step` for `batch_sizes` rows, captured on `device` by `new_capture`.

        batch_sizes: AUTO_CUDA_GRAPHS for auto_batch_sizes of the largest batch `capture` is
        given.
        block_bytes: the keys and values of one KV block of one layer, which a step gathers per
        row and table column; 0 when the step's attention gathers nothing (Triton's kernel).
        block_size: tokens per block. new_capture: how a graph is captured; tests on the CPU pass
        one that replays the function on the same buffers, which holds this class to the
        contract a CUDA graph imposes."""
        self.step = step
        self.requested = None if batch_sizes == AUTO_CUDA_GRAPHS else sorted(batch_sizes)
        self.batch_sizes: list[int] = self.requested or []
        self.device = device
        self.block_bytes = block_bytes
        self.block_size = block_size
        self.new_capture = new_capture
        self.widths: list[int] = []
        self.graphs: dict[tuple[int, int], CapturedStep] = {}

    def capture(self, max_width: int, largest_batch: int = MAX_AUTO_BATCH) -> None:
        """Captures the buckets for tables up to max_width blocks (the longest request's).

        `largest_batch` (largest_decode_batch) bounds the batch sizes when none were requested.
        Largest first, so the pool is sized once by the largest; a bucket whose attention would
        gather more than MAX_GATHER_BYTES a layer is left to eager steps. The steps captured
        write into block 0 only. On failure no graph is kept and the error is raised."""
        self.release()
        started = time.perf_counter()
        reserved = torch.cuda.memory_reserved(self.device) if self.device.type == "cuda" else 0
        if self.requested is None:
            self.batch_sizes = auto_batch_sizes(largest_batch, gathers=bool(self.block_bytes))
        capture = self.new_capture(self.device)
        # a kernel reading each row's context in place (block_bytes 0) costs the same at any
        # table width: one width, the longest request's, serves every step
        widths = width_buckets(max_width) if self.block_bytes else [max(max_width, 1)]
        outputs = None  # the first (largest) graph's: every later graph writes its rows there
        try:
            for rows in reversed(self.batch_sizes):
                for width in reversed(widths):
                    if rows * width * self.block_bytes > MAX_GATHER_BYTES:
                        continue
                    inputs = (torch.zeros(rows, dtype=torch.long, device=self.device),
                              torch.zeros(rows, dtype=torch.long, device=self.device),
                              torch.zeros(rows, width, dtype=torch.long, device=self.device),
                              torch.zeros(rows, dtype=torch.long, device=self.device))
                    step = self.step if outputs is None else _writing_into(self.step, outputs)
                    (logits, hidden), replay = capture(step, inputs)
                    if outputs is None:
                        outputs = logits, hidden
                    self.graphs[rows, width] = CapturedStep(*inputs, logits, hidden, replay)
        except BaseException:
            self.release()
            raise
        self.widths = widths
        grown = (torch.cuda.memory_reserved(self.device) - reserved) >> 20 if reserved else 0
        log.info("decode step captured in %d CUDA graphs in %.1f s (%d MiB more reserved): "
                 "batch sizes %s, table widths %s blocks; %d buckets over %d MiB of keys and "
                 "values a layer left to eager steps", len(self.graphs),
                 time.perf_counter() - started, grown, ",".join(map(str, self.batch_sizes)),
                 ",".join(map(str, widths)),
                 len(self.batch_sizes) * len(widths) - len(self.graphs), MAX_GATHER_BYTES >> 20)

    def width(self, seq_lens: torch.Tensor, table_width: int) -> int:
        """The block-table columns a step of rows at `seq_lens` reads, to pick its graph.

        Where one width holds every table (attention reading in place), the table's own width,
        with nothing read back from the device; where graphs come in widths (attention that
        gathers), the longest context's, one read of the lengths."""
        if len(self.widths) == 1 and table_width <= self.widths[0]:
            return table_width
        return (int(seq_lens.max()) + self.block_size) // self.block_size

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


def _writing_into(step: Step, outputs: Outputs) -> Step:
    """`step`, its results copied into the first rows of `outputs` and those rows returned.

    Inside a graph the step's own results are temporaries the pool gives to the next capture:
    only the largest graph's outputs stay allocated."""

    def step_into(*inputs: torch.Tensor) -> Outputs:
        logits, hidden = step(*inputs)
        rows = logits.shape[0]
        outputs[0][:rows].copy_(logits)
        outputs[1][:rows].copy_(hidden)
        return outputs[0][:rows], outputs[1][:rows]
    return step_into
