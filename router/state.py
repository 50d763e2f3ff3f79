"""What a running router holds, as every API module sees it (`request.app[STATE]`)."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from router.batcher import Batcher
from router.block_allocator import BlockAllocator
from router.chat_template import ChatTemplate
from router.config import RouterConfig, TokenLimits
from router.errors import UnhealthyError
from router.generate_one_request import GenerationDefaults
from router.infer import Infer
from router.metrics import Metrics
from router.openapi import VERSION
from router.shard_client import ShardedClient, ShardError
from router.shard_convert import ShardInfo
from router.tokenizer import RouterTokenizer
from router.validation import ValidationLimits

log = logging.getLogger("tgi.router")


@dataclass
class RouterState:
    config: RouterConfig
    tokenizer: RouterTokenizer
    client: ShardedClient
    shard_info: ShardInfo
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

    @property
    def generation_defaults(self) -> GenerationDefaults:
        return self.config.generation_defaults()

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
            # /api/generate-one|batch: what a call gets for a generation_config field it leaves
            # out, and how long its request_id session keeps its KV blocks
            "generation_defaults": self.generation_defaults.as_json(),
            "session_ttl": config.session_ttl, "max_sessions": config.max_sessions,
            "session_kv_share": config.session_kv_share,
            "router": "tgi-py-router", "version": VERSION, "sha": None, "docker_label": None,
        }

    async def check_health(self) -> None:
        """Returns when the shards answer; raises the UnhealthyError of a 503 otherwise."""
        if not self.batcher.healthy:
            raise UnhealthyError("the model shards are restarting")
        try:
            await self.client.health()
        except ShardError as err:
            log.warning("health check failed: %s", err)
            raise UnhealthyError() from None


STATE = web.AppKey("state", RouterState)
