"""The aiohttp application: routes, error middleware, and start-up (connect, warm up, size the KV pool)."""
from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from router.api import completions, generate_one, grpc_service, openai, sglang, tgi
from router.batch import NewBatch, ShardRequest
from router.batcher import Batcher
from router.block_allocator import BlockAllocator
from router.chat_template import ChatTemplate
from router.config import RouterConfig, TokenLimits
from router.infer import Infer
from router.metrics import Metrics
from router.middleware import api_key_middleware, cors_middleware, error_middleware
from router.prefix_cache import PrefixCache
from router.recovery import RecoveryPolicy
from router.request_queue import RequestQueue
from router.scheduling import SchedulingLimits
from router.schemas import GenerateRequest, SamplingParams, StoppingParams
from router.shard_client import ShardedClient
from router.state import STATE, RouterState
from router.tokenizer import RouterTokenizer
from router.validation import ValidationLimits

# Every API the router serves: each module turns its wire format into core requests and the core's
# events into its wire format, and registers itself (routes, or a server of its own).
API_MODULES = (tgi, sglang, openai, completions, generate_one, grpc_service)

log = logging.getLogger("tgi.router")


def warmup_batch(limits: TokenLimits, max_batch_size: int | None,
                 prefill_tokens: int | None = None) -> NewBatch:
    """Requests of max_input_tokens tokens until they fill the prefill budget, as TGI warms up."""
    requests = []
    remaining = limits.max_batch_prefill_tokens if prefill_tokens is None else prefill_tokens
    while remaining > 0 and (max_batch_size is None or len(requests) < max_batch_size):
        length = min(limits.max_input_tokens, remaining)
        request = GenerateRequest(
            inputs="", input_ids=[1] * length,
            sampling=SamplingParams(do_sample=True, temperature=0.9, top_k=10, top_p=0.9,
                                    typical_p=0.9, repetition_penalty=1.2, seed=0),
            stopping=StoppingParams(max_new_tokens=2, ignore_eos=True), top_n_tokens=5,
            skip_special_tokens=False)
        requests.append(ShardRequest(len(requests), request, blocks=[]))  # warm-up has no blocks
        remaining -= length
    return NewBatch(id=0, requests=requests, max_tokens=0, max_blocks=0)


async def warm_up(client: ShardedClient, config: RouterConfig, limits: TokenLimits,
                  block_size: int, *, known_pool_blocks: int | None = None) -> int:
    """Runs the largest batch the router may send; returns the KV pool's size in blocks.

    With `known_pool_blocks` (a restarted group of the same model, limits and machine, whose
    first warm-up already ran the largest batch), one short request checks that the model runs
    and the pool is allocated at the size it had: on CPU the full warm-up is most of a restart."""
    batch = warmup_batch(limits, config.max_batch_size,
                         prefill_tokens=None if known_pool_blocks is None else 16)
    total_tokens = config.max_batch_total_tokens or 0
    if known_pool_blocks is not None:
        total_tokens = (known_pool_blocks - 1) * block_size
    num_blocks = await client.warmup(
        batch, max_input_tokens=limits.max_input_tokens,
        max_prefill_tokens=limits.max_batch_prefill_tokens, max_total_tokens=limits.max_total_tokens,
        max_batch_total_tokens=total_tokens)
    capacity = (num_blocks - 1) * block_size  # block 0 is never handed out
    if limits.max_total_tokens > capacity:
        raise ValueError(f"Not enough memory to handle max_total_tokens={limits.max_total_tokens}: the "
                         f"KV pool holds {capacity} tokens; lower --max-total-tokens or raise "
                         "--max-batch-total-tokens")
    log.info("KV pool: %d blocks of %d tokens (%d tokens)", num_blocks, block_size, capacity)
    return num_blocks


def recovery_policy(client: ShardedClient, config: RouterConfig, limits: TokenLimits,
                    allocator: BlockAllocator) -> RecoveryPolicy:
    """How the router gets its shards back after the launcher restarted them: the same socket,
    the same model and limits, a short warm-up that allocates the pool at its size, and empty
    caches."""

    async def reconnect() -> int:
        await client.reconnect(config.master_shard_uds_path, timeout=2.0)
        await client.clear_cache()
        return await warm_up(client, config, limits, allocator.block_size,
                             known_pool_blocks=allocator.num_blocks)

    return RecoveryPolicy(reconnect=reconnect, is_alive=client.is_same_group_alive,
                          timeout=config.shard_recovery_timeout)


async def build_state(config: RouterConfig) -> RouterState:
    tokenizer = RouterTokenizer(config.tokenizer_path, workers=config.validation_workers)
    client = await ShardedClient.connect(config.master_shard_uds_path)
    await client.clear_cache()
    shard_info = await client.info()
    limits = TokenLimits.resolve(config, shard_info.max_position_embeddings,
                                 chunking=shard_info.support_chunking)
    num_blocks = await warm_up(client, config, limits, shard_info.block_size)
    allocator = BlockAllocator(num_blocks, shard_info.block_size)
    capacity = allocator.num_usable_blocks * allocator.block_size
    scheduling = SchedulingLimits(
        max_batch_prefill_tokens=limits.max_batch_prefill_tokens, max_batch_total_tokens=capacity,
        waiting_served_ratio=config.waiting_served_ratio,
        max_waiting_tokens=config.max_waiting_tokens, max_batch_size=config.max_batch_size)
    metrics = Metrics(max_input_tokens=limits.max_input_tokens,
                      max_total_tokens=limits.max_total_tokens)
    prefix_cache = None
    if config.prefix_caching == "on" and shard_info.use_prefix_caching:
        prefix_cache = PrefixCache(allocator)
    queue = RequestQueue(allocator, prefix_cache, chunking=shard_info.support_chunking)
    batcher = Batcher(client, queue, allocator, scheduling, metrics,
                      recovery_policy(client, config, limits, allocator),
                      session_limits=config.session_limits())
    infer = Infer(batcher, metrics, max_concurrent_requests=config.max_concurrent_requests)
    validation_limits = ValidationLimits(limits, config.max_best_of, config.max_stop_sequences,
                                         config.max_top_n_tokens)
    return RouterState(config, tokenizer, client, shard_info, limits, validation_limits,
                       allocator, batcher, infer, metrics,
                       ChatTemplate.from_model_dir(config.tokenizer_path))


def create_app(state: RouterState) -> web.Application:
    config = state.config
    middlewares = []
    if config.cors_allow_origin:
        middlewares.append(cors_middleware(config.cors_allow_origin))
    middlewares.append(error_middleware)
    if config.api_key:
        middlewares.append(api_key_middleware(config.api_key))
    app = web.Application(middlewares=middlewares, client_max_size=config.payload_limit)
    app[STATE] = state
    for api in API_MODULES:
        api.register(app)

    async def start_batcher(app):
        state.tasks.append(asyncio.create_task(_supervise(state.batcher.run(), state.fatal)))

    async def stop_batcher(app):
        for task in state.tasks:
            task.cancel()
        await asyncio.gather(*state.tasks, return_exceptions=True)
        await state.client.close()

    app.on_startup.append(start_batcher)
    app.on_cleanup.append(stop_batcher)
    return app


async def _supervise(coro, fatal: asyncio.Event) -> None:
    try:
        await coro
    except asyncio.CancelledError:
        raise
    except Exception:
        # the loop must never die silently: without it every request would hang
        log.exception("the batching loop crashed; stopping the router")
        fatal.set()
