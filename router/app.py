"""The aiohttp application: routes, error middleware, and start-up (connect, warm up, size the KV pool)."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from proto import generate_pb2 as pb
from router.api import STATE, openai, tgi
from router.batcher import Batcher, SchedulingLimits
from router.block_allocator import BlockAllocator
from router.chat_template import ChatTemplate
from router.config import RouterConfig, TokenLimits
from router.infer import Infer
from router.metrics import Metrics
from router.middleware import api_key_middleware, cors_middleware, error_middleware
from router.openapi import VERSION
from router.prefix_cache import PrefixCache
from router.recovery import RecoveryPolicy
from router.request_queue import RequestQueue
from router.shard_client import ShardedClient
from router.tokenizer import RouterTokenizer
from router.validation import ValidationLimits

log = logging.getLogger("tgi.router")


@dataclass
class RouterState:
    config: RouterConfig
    tokenizer: RouterTokenizer
    client: ShardedClient
    shard_info: pb.InfoResponse
    limits: TokenLimits
    validation_limits: ValidationLimits
    allocator: BlockAllocator
    batcher: Batcher
    infer: Infer
    metrics: Metrics
    chat_template: ChatTemplate | None
    tasks: list[asyncio.Task] = field(default_factory=list)
    # set when the batching loop dies: the process must exit rather than leave requests hanging
    fatal: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def model_name(self) -> str:
        return self.config.model_id or Path(self.config.tokenizer_path).name

    @property
    def compute_type(self) -> str:
        return f"{self.shard_info.world_size}-{self.shard_info.device_type}"

    def info_json(self) -> dict:
        config = self.config
        return {
            "model_id": self.model_name,
            "model_sha": None, "model_pipeline_tag": "text-generation",
            "model_dtype": self.shard_info.dtype, "model_device_type": self.shard_info.device_type,
            "max_concurrent_requests": config.max_concurrent_requests,
            "max_best_of": config.max_best_of, "max_stop_sequences": config.max_stop_sequences,
            "max_input_tokens": self.limits.max_input_tokens,
            "max_total_tokens": self.limits.max_total_tokens,
            "max_batch_prefill_tokens": self.limits.max_batch_prefill_tokens,
            "max_batch_total_tokens": self.allocator.num_usable_blocks * self.allocator.block_size,
            "shard_recovery_timeout": config.shard_recovery_timeout,
            "waiting_served_ratio": config.waiting_served_ratio,
            "max_waiting_tokens": config.max_waiting_tokens,
            "max_batch_size": config.max_batch_size,
            "prefix_caching": self.batcher.queue.prefix_cache is not None,
            "validation_workers": config.validation_workers,
            "max_client_batch_size": config.max_client_batch_size,
            "router": "tgi-py-router", "version": VERSION, "sha": None, "docker_label": None,
        }


def warmup_batch(limits: TokenLimits, max_batch_size: int | None,
                 prefill_tokens: int | None = None) -> pb.Batch:
    """Requests of max_input_tokens tokens until they fill the prefill budget, as TGI warms up."""
    requests = []
    remaining = limits.max_batch_prefill_tokens if prefill_tokens is None else prefill_tokens
    while remaining > 0 and (max_batch_size is None or len(requests) < max_batch_size):
        length = min(limits.max_input_tokens, remaining)
        requests.append(pb.Request(
            id=len(requests), input_ids=[1] * length,
            parameters=pb.NextTokenChooserParameters(do_sample=True, temperature=0.9, top_k=10,
                                                     top_p=0.9, typical_p=0.9,
                                                     repetition_penalty=1.2, seed=0),
            stopping_parameters=pb.StoppingCriteriaParameters(max_new_tokens=2,
                                                              ignore_eos_token=True),
            top_n_tokens=5))
        remaining -= length
    return pb.Batch(id=0, requests=requests, size=len(requests))


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
    warm = await client.warmup(pb.WarmupRequest(
        batch=batch, max_input_tokens=limits.max_input_tokens,
        max_prefill_tokens=limits.max_batch_prefill_tokens, max_total_tokens=limits.max_total_tokens,
        max_batch_total_tokens=total_tokens))
    capacity = (warm.num_blocks - 1) * block_size  # block 0 is never handed out
    if limits.max_total_tokens > capacity:
        raise ValueError(f"Not enough memory to handle max_total_tokens={limits.max_total_tokens}: the "
                         f"KV pool holds {capacity} tokens; lower --max-total-tokens or raise "
                         "--max-batch-total-tokens")
    log.info("KV pool: %d blocks of %d tokens (%d tokens)", warm.num_blocks, block_size, capacity)
    return warm.num_blocks


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
                      recovery_policy(client, config, limits, allocator))
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
    tgi.add_routes(app)
    openai.add_routes(app)

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
