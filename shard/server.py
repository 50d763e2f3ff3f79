"""The gRPC servicer: converts messages, runs the engine on one worker thread, maps errors to statuses."""
from __future__ import annotations

import asyncio
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch
from opentelemetry.trace import SpanKind

from proto import generate_pb2 as pb
from proto import generate_pb2_grpc as pb_grpc
from proto.tracing import extract_metadata, tracer, tracing_enabled
from shard import convert
from shard.config import ShardConfig
from shard.distributed import CollectiveFailed
from shard.embedder import Embedder, EmbedInput
from shard.adapters.adapter_set import AdapterExists
from shard.adapters.peft_files import AdapterError
from shard.engine import AdapterInUse, BatchNotFound, Engine

log = logging.getLogger("tgi.shard")
_TRACER = tracer("tgi.shard")


def engine_thread() -> ThreadPoolExecutor:
    """The one thread that does all torch work of the shard.

    One: the engine is not re-entrant, and the event loop stays free for Health. The same one from
    loading to serving: OpenMP keeps a team of spinning threads per calling thread, and two teams on
    two cores slow every matmul by a third.
    """
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")


# the most decode steps one call runs (DecodeRequest.max_steps asks; the router's default is 4):
# a call that never ended would hold the router and every stream waiting on it
MAX_STEPS_PER_CALL = 64


def _allocation_failed(err: BaseException) -> bool:
    """Whether a step failed for memory outside the caching allocator.

    The caching allocator raises OutOfMemoryError; cuBLAS and NCCL report theirs as a plain
    RuntimeError."""
    text = str(err)
    return "out of memory" in text.lower() or "ALLOC_FAILED" in text


class ShardServicer(pb_grpc.TextGenerationServiceServicer):
    def __init__(self, engine: Engine, config: ShardConfig, info: pb.InfoResponse,
                 on_fatal_error, worker: ThreadPoolExecutor, urls: list[str],
                 embedder: Embedder | None = None):
        self.engine = engine
        self.embedder = embedder  # None: Embed refuses every input
        # where the router reaches each rank: unix sockets here, host:port on other machines
        self.urls = urls
        self.config = config
        self.info = info
        self.on_fatal_error = on_fatal_error
        self.instance_id = uuid.uuid4().hex  # tells the router a restarted shard from this one
        # the thread that built the engine runs every step: see engine_thread()
        self._worker = worker
        # reads and checks adapter files, whose size and config a client chooses, while the
        # engine thread goes on stepping; one, as the router loads one adapter at a time
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="adapter-reader")

    async def _run(self, context: grpc.aio.ServicerContext, fn, *args, span: str | None = None):
        if span is not None and tracing_enabled():
            parent = extract_metadata(context.invocation_metadata())
            with _TRACER.start_as_current_span(span, context=parent, kind=SpanKind.SERVER):
                return await self._call(context, fn, *args)
        return await self._call(context, fn, *args)

    async def _call(self, context: grpc.aio.ServicerContext, fn, *args):
        try:
            return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)
        except BatchNotFound as err:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(err))
        except (ValueError, KeyError) as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except Exception as err:  # a failed step fails its batch; a dead device stops the shard
            log.exception("step failed")
            if isinstance(err, CollectiveFailed):  # the ranks' group is gone: a new one is needed
                self.on_fatal_error(err)
            elif self.engine.runner.device.type == "cuda":
                if isinstance(err, torch.cuda.OutOfMemoryError):
                    torch.cuda.empty_cache()  # this batch did not fit; the next may
                else:
                    if _allocation_failed(err):  # the same, from outside the allocator
                        torch.cuda.empty_cache()
                    if await asyncio.get_running_loop().run_in_executor(self._worker,
                                                                        self._device_lost):
                        self.on_fatal_error(err)
            await context.abort(grpc.StatusCode.INTERNAL, f"{type(err).__name__}: {err}")

    def _device_lost(self) -> bool:
        """After a failed step on CUDA: whether the device still runs work.

        A sticky error (a device-side assert, an illegal address) fails every later call, and only
        a new process recovers; a shape or argument error leaves the device as it was."""
        try:
            torch.cuda.synchronize(self.engine.runner.device)
            torch.zeros(1, device=self.engine.runner.device).item()
            return False
        except RuntimeError:
            return True

    async def Info(self, request, context):
        return self.info

    async def Health(self, request, context):
        if self.engine.runner.device.type == "cuda":
            try:
                torch.zeros(1, device=self.engine.runner.device)
            except RuntimeError as err:  # a sticky CUDA error: only a new process recovers
                self.on_fatal_error(err)
                raise
        return pb.HealthResponse(instance_id=self.instance_id)

    async def ServiceDiscovery(self, request, context):
        return pb.ServiceDiscoveryResponse(urls=self.urls)

    async def ClearCache(self, request, context):
        batch_id = request.id if request.HasField("id") else None
        await self._run(context, self.engine.clear, batch_id)
        if batch_id is None and self.embedder is not None:
            await self._run(context, self.embedder.clear)
        return pb.ClearCacheResponse()

    async def FilterBatch(self, request, context):
        info = await self._run(context, self.engine.filter, request.batch_id,
                               list(request.request_ids))
        return pb.FilterBatchResponse(batch=convert.cached_batch(info))

    async def _refuse_generation(self, context) -> None:
        if self.info is not None and not self.info.generates:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"{self.info.architecture} is an encoder: it embeds and "
                                "generates nothing")

    async def Warmup(self, request, context):
        if self.info is not None and not self.info.generates:
            # an encoder keeps no KV: its warm-up is one embedding of the longest input, and the
            # pool it answers one request's worth that nothing is ever written to (the router's
            # accounting needs one to exist)
            longest = [(0, [0] * min(request.max_input_tokens or 1, self.info.max_embed_tokens))]
            await self._run(context, self.embedder.embed, longest)
            blocks = -(-max(request.max_total_tokens, 1) // self.engine.block_size) + 1
            return pb.WarmupResponse(max_supported_total_tokens=request.max_total_tokens,
                                     max_input_tokens=request.max_input_tokens,
                                     max_total_tokens=request.max_total_tokens,
                                     num_blocks=blocks)
        requests = [convert.new_request(r, self.engine.hidden_size)
                    for r in request.batch.requests]
        max_batch_size = (request.max_batch_size if request.HasField("max_batch_size")
                          else None)
        result = await self._run(context, self.engine.warmup, requests,
                                 request.max_batch_total_tokens, request.max_total_tokens,
                                 max_batch_size)
        return pb.WarmupResponse(max_supported_total_tokens=result.max_supported_total_tokens,
                                 max_input_tokens=request.max_input_tokens,
                                 max_total_tokens=request.max_total_tokens,
                                 num_blocks=result.num_blocks)

    async def Prefill(self, request, context):
        await self._refuse_generation(context)
        requests, rejected = [], []
        for message in request.batch.requests:
            try:
                requests.append(convert.new_request(message, self.engine.hidden_size))
            except Exception as err:  # one request's data: that request alone is refused
                rejected.append((message.id, str(err)))
        cached = request.cached_batch.id if request.HasField("cached_batch") else None
        result = await self._run(context, self.engine.prefill, request.batch.id, requests, cached,
                                 span="prefill")
        result.rejected = rejected + result.rejected
        return convert.step_response(result, pb.PrefillResponse)

    async def LoadAdapter(self, request, context):
        if not request.name or not request.path:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "LoadAdapter needs an adapter name and a directory")
        try:
            read = await asyncio.get_running_loop().run_in_executor(
                self._reader, self.engine.read_adapter, request.name, request.path)
            loaded = await self._in_worker(self.engine.install_adapter, request.name, read)
        except AdapterExists as err:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(err))
        except AdapterError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except (MemoryError, torch.OutOfMemoryError) as err:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"not enough memory for adapter {request.name!r}: {err}")
        log.info("loaded LoRA adapter %s (rank %d, %s) from %s", loaded.name, loaded.rank,
                 ", ".join(loaded.target_modules), request.path)
        return pb.LoadAdapterResponse(rank=loaded.rank, alpha=loaded.alpha,
                                      scaling=loaded.scaling,
                                      target_modules=loaded.target_modules,
                                      base_model=loaded.base_model)

    async def UnloadAdapter(self, request, context):
        try:
            held = await self._in_worker(self.engine.unload_adapter, request.name)
        except KeyError:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"no LoRA adapter named {request.name!r} is loaded")
        except AdapterInUse as err:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        log.info("unloaded LoRA adapter %s (the adapters left hold %d bytes)", request.name, held)
        return pb.UnloadAdapterResponse()

    async def _in_worker(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

    async def _decode_args(self, request, context) -> tuple[list[int], int]:
        """A DecodeRequest's batch ids and the steps the call may take."""
        if not request.batches:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Decode needs at least one batch")
        return [b.id for b in request.batches], min(max(1, request.max_steps), MAX_STEPS_PER_CALL)

    async def Embed(self, request, context):
        inputs = [EmbedInput(i.id, list(i.input_ids), i.cache_len,
                             i.cache_len + i.chunk_len if i.HasField("chunk_len") else None)
                  for i in request.inputs]
        if self.embedder is None:
            return pb.EmbedResponse(rejected=[pb.RejectedRequest(request_id=i.id, reason="this "
                                                                 "shard cannot embed")
                                              for i in inputs])
        result = await self._run(context, self.embedder.embed, inputs, span="embed")
        return pb.EmbedResponse(
            embeddings=[pb.Embedding(id=i, values=v.tolist()) for i, v in result.vectors.items()],
            rejected=[pb.RejectedRequest(request_id=i, reason=why) for i, why in result.rejected],
            forward_ns=result.forward_ns)

    async def Decode(self, request, context):
        await self._refuse_generation(context)
        batch_ids, steps = await self._decode_args(request, context)
        result = await self._run(context, self.engine.decode, batch_ids, steps, span="decode")
        return convert.step_response(result, pb.DecodeResponse)

    async def DecodeStream(self, request, context):
        """Decode, each step sent as it ends.

        A step is converted here while the engine thread computes the next one."""
        await self._refuse_generation(context)
        batch_ids, steps = await self._decode_args(request, context)
        loop = asyncio.get_running_loop()
        ended: asyncio.Queue = asyncio.Queue()

        def on_step(result):  # on the engine thread
            loop.call_soon_threadsafe(ended.put_nowait, result)

        call = asyncio.ensure_future(self._run(context, self.engine.decode, batch_ids, steps,
                                               on_step, span="decode"))
        step = None
        try:
            while True:
                step = asyncio.ensure_future(ended.get())
                await asyncio.wait({step, call}, return_when=asyncio.FIRST_COMPLETED)
                if not step.done():  # the call ended: the steps it handed over come first
                    step.cancel()
                    break
                yield _step_message(step.result())
            while not ended.empty():
                yield _step_message(ended.get_nowait())
            yield convert.step_response(await call, pb.DecodeResponse)
        finally:
            if step is not None and not step.done():
                step.cancel()
            if not call.done():  # the router went away; the engine thread ends its call anyway
                call.add_done_callback(lambda done: done.cancelled() or done.exception())


def _step_message(step) -> pb.DecodeResponse:
    """A DecodeStream message before the last: one step's generations and times alone."""
    return pb.DecodeResponse(generations=[convert.generation(g) for g in step.generations],
                             more=True)
