"""One running model as the API modules see it: its tokenizer, limits, scheduler and shard client.

Every model that runs has one, built when it starts (connect to its shard group, warm up, size the KV
pool) and closed when it stops; the API modules look one up by name (router/state.py).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import InitVar, dataclass, field
from pathlib import Path

from router import VERSION
from router.config.model import ModelSettings
from router.core.embedding import EmbeddingQueue
from router.core.generation import Infer
from router.errors import ModelStateError, RouterError, UnhealthyError
from router.inputs.chat_template import ChatTemplate
from router.inputs.generation_config import GenerationDefaults
from router.inputs.images.family import ImageFamily, image_family
from router.inputs.tokenizer import RouterTokenizer
from router.inputs.validation import TokenLimits, ValidationLimits
from router.kv.accounting import kv_accounting
from router.kv.block_allocator import BlockAllocator
from router.lifecycle.adapters import AdapterLinks, AdapterStore
from router.lifecycle.limits import resolve_limits
from router.lifecycle.registry import STOPPED
from router.lifecycle.sessions import RequestSessions
from router.lifecycle.settings import ChatPrompt
from router.scheduler.batcher import Batcher
from router.scheduler.policy import SchedulingLimits
from router.scheduler.recovery import RecoveryPolicy
from router.scheduler.request_queue import RequestQueue
from router.schemas import GenerateRequest, SamplingParams, StoppingParams
from router.shards.client import ShardedClient, ShardError
from router.shards.convert import ShardInfo
from router.shards.step_types import NewBatch, ShardRequest
from router.telemetry.metrics import Metrics

log = logging.getLogger("tgi.router")


@dataclass
class ServedModel:
    config: ModelSettings
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
    # its request_id sessions (generate-one/batch), made with the KV pool
    sessions: RequestSessions
    # Jan's per-model request defaults (router.lifecycle.settings.PARAMETERS) and chat prompt pieces
    request_defaults: dict = field(default_factory=dict)
    chat_prompt: ChatPrompt = field(default_factory=ChatPrompt)
    tasks: list[asyncio.Task] = field(default_factory=list)
    adapters: AdapterStore = None  # its LoRA adapters; made in __post_init__ unless given
    images: ImageFamily | None = None  # how its prompts hold images; None: it reads text only
    embeddings: EmbeddingQueue | None = None  # its Embed calls; made in __post_init__ unless given
    # Jan's `embedding: true`: serve embeddings of a model that does not declare itself made to
    embedding_asked: bool = False
    # what its adapter store, when made here, asks of the server: Hub fetches, names in use
    adapter_links: InitVar[AdapterLinks] = AdapterLinks()

    def __post_init__(self, adapter_links: AdapterLinks):
        if self.embeddings is None:
            batcher = self.batcher
            self.embeddings = EmbeddingQueue(self.client, decode_s=lambda: (
                batcher.steps.shard_step_cost.for_chunk(len(batcher.running) > 0)),
                decode_calls=lambda: batcher.steps.decode_calls,
                chunkable=self.shard_info.generates, recovery=batcher.recovery)
        if self.adapters is None:
            self.adapters = AdapterStore(self.client, self.infer.adapters, self.batcher,
                                         self.metrics, parent=self.model_name,
                                         links=adapter_links, max_loras=self.config.max_loras,
                                         max_files_bytes=self.shard_info.max_adapter_bytes)

    @property
    def model_name(self) -> str:
        return self.config.model_id or Path(self.config.tokenizer_path).name

    @property
    def embeds(self) -> bool:
        """Whether it serves embeddings: it can pool, and was made to embed or asked to."""
        info = self.shard_info
        return bool(info.pooling) and (info.declares_embedding or self.embedding_asked)

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
            "model_sha": None, "model_pipeline_tag": ("text-generation" if self.shard_info.generates
                                                      else "feature-extraction"),
            # not in TGI's /info: whether /v1/embeddings (and /embed, /api/embed) serve it
            "embeds": self.embeds,
            "model_dtype": self.shard_info.dtype, "model_device_type": self.shard_info.device_type,
            # not in TGI's /info: which of the shards' model families serves, and how its weights
            # are held where not in model_dtype (a GGUF's types as served; None: all in it)
            "model_architecture": self.shard_info.architecture,
            "quantization": self.shard_info.quantization or None,
            # not in TGI's /info: whether its requests may hold images
            "takes_images": self.images is not None,
            "max_concurrent_requests": config.max_concurrent_requests,
            "max_best_of": config.max_best_of, "max_stop_sequences": config.max_stop_sequences,
            "max_input_tokens": self.limits.max_input_tokens,
            "max_total_tokens": self.limits.max_total_tokens,
            "max_batch_prefill_tokens": self.limits.max_batch_prefill_tokens,
            "max_batch_total_tokens": self.kv_capacity_tokens,
            "shard_recovery_timeout": config.shard_recovery_timeout,
            "waiting_served_ratio": config.waiting_served_ratio,
            "max_waiting_tokens": config.max_waiting_tokens,
            "max_batch_size": config.max_batch_size,
            "max_decode_steps_per_call": config.max_decode_steps_per_call,
            "prefix_caching": self.batcher.queue.prefix_cache is not None,
            "speculate": self.shard_info.speculate,
            "validation_workers": config.validation_workers,
            "max_client_batch_size": config.max_client_batch_size,
            # /api/generate-one|batch: what a call gets for a generation_config field it leaves
            # out, and how long its request_id session keeps its KV blocks
            "generation_defaults": self.generation_defaults.as_json(),
            "session_ttl": config.session_ttl, "max_sessions": config.max_sessions,
            "session_kv_share": config.session_kv_share,
            # not in TGI's /info: the LoRA adapters loaded (a request names one by `name`)
            "lora_adapters": self.adapters.info_json(), "max_loras": config.max_loras,
            "router": "tgi-py-router", "version": VERSION, "sha": None, "docker_label": None,
        }

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the KV pool holds (what TGI reports as max_batch_total_tokens)."""
        return self.allocator.num_usable_blocks * self.allocator.block_size

    @property
    def kv_block_size(self) -> int:
        return self.allocator.block_size

    def flush_prefix_cache(self) -> bool:
        """Lets go of every cached prompt block no request holds; whether the cache is empty."""
        return self.batcher.flush_prefix_cache()

    async def check_health(self) -> None:
        """Returns when the shards answer; raises the UnhealthyError of a 503 otherwise."""
        if not self.batcher.healthy:
            raise UnhealthyError("the model shards are restarting")
        try:
            await self.client.health()
        except ShardError as err:
            log.warning("health check failed: %s", err)
            raise UnhealthyError() from None

    def start(self, supervise) -> None:
        """Runs the batching loop, under `supervise` (a coroutine wrapper), and session expiry."""
        self.tasks.append(asyncio.create_task(supervise(self.batcher.run())))
        if self.sessions is not None:
            every = max(min(self.config.session_ttl / 4, 5.0), 0.05)
            self.tasks.append(asyncio.create_task(self.sessions.expire_every(every)))

    async def close(self) -> None:
        """Stops the batching loop and refuses what still arrives.

        A request still in flight fails with a 503, and one that reaches the queue from now on (it
        was validating when the stop began) with a 409."""
        name = self.model_name
        await self.end_requests(UnhealthyError(f"model {name!r} stopped"),
                                refusal=lambda: ModelStateError(f"model {name!r} stopped",
                                                                STOPPED))
        await self.client.close()

    async def end_requests(self, error: RouterError, *,
                           refusal: Callable[[], RouterError]) -> None:
        """Stops the batching loop: each request in flight hears `error`, each later one `refusal()`.

        A non-streamed request answers with the error, a stream ends with its error event. The
        first call decides; a second (close() after the router's drain) changes nothing.
        """
        self.batcher.close(refusal)
        self.embeddings.close(refusal, error)
        self.batcher.stop_waiting()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks.clear()
        self.batcher.fail_everything(error)


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


async def warm_up(client: ShardedClient, config: ModelSettings, limits: TokenLimits,
                  block_size: int, *, known_pool_blocks: int | None = None) -> int:
    """Runs the largest batch of prompts the scheduler forms; returns the KV pool's size in blocks.

    The batch is the prefill budget's. On shards that cannot chunk, a prompt over a smaller
    budget than --max-input-tokens still goes alone, in one forward, as TGI sends it.

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
        max_batch_total_tokens=total_tokens, max_batch_size=config.max_batch_size)
    capacity = (num_blocks - 1) * block_size  # block 0 is never handed out
    if limits.max_total_tokens > capacity:
        raise ValueError(f"Not enough memory to handle max_total_tokens={limits.max_total_tokens}: the "
                         f"KV pool holds {capacity} tokens; lower --max-total-tokens or raise "
                         "--max-batch-total-tokens")
    log.info("%s: KV pool of %d blocks of %d tokens (%d tokens)", config.model_id, num_blocks,
             block_size, capacity)
    return num_blocks


def recovery_policy(client: ShardedClient, config: ModelSettings, limits: TokenLimits,
                    allocator: BlockAllocator,
                    reload_adapters: Callable[[], Awaitable[None]] | None = None
                    ) -> RecoveryPolicy:
    """How the router gets a model's shards back after the launcher restarted them.

    The same socket, the same model and limits, a short warm-up that allocates the pool at its
    size, empty caches, and its LoRA adapters loaded again (`reload_adapters`) before any
    request runs.
    """

    async def reconnect() -> int:
        await client.reconnect(config.master_shard_uds_path, timeout=2.0)
        await client.clear_cache()
        num_blocks = await warm_up(client, config, limits, allocator.block_size,
                                   known_pool_blocks=allocator.num_blocks)
        if reload_adapters is not None:
            await reload_adapters()
        return num_blocks

    return RecoveryPolicy(reconnect=reconnect, is_alive=client.is_same_group_alive,
                          timeout=config.shard_recovery_timeout)


_now = time.monotonic  # build_served's clock (tests move it)
# seconds a restarted group may take to load, as long as the launcher waits for one to start
GROUP_START_WAIT = 600.0


async def build_served(config: ModelSettings, *, through_restarts: bool = False,
                       adapter_links: AdapterLinks = AdapterLinks()) -> ServedModel:
    """Connects to a model's shards, warms them up, and builds its scheduler.

    `through_restarts`: a group that dies meanwhile (the launcher restarts it) is waited for while
    it loads, up to the launcher's own bound on a start (GROUP_START_WAIT), and warmed up again;
    else its death is the error. `adapter_links`: what its adapter store asks of the server.
    """
    deadline = None  # none until the group is found gone: a first warm-up may take minutes
    while True:
        client = await _connect(config, deadline)
        try:
            return await _build(config, client, adapter_links)
        except ShardError as err:
            lost = not await client.is_same_group_alive()
            await client.close()
            if not lost:
                raise
            if not through_restarts:  # say what happened, not only what the channel saw
                raise ShardError(f"its shards exited while they were warmed up ({err})") from err
            log.warning("the shards went away while warming up (%s): waiting for their restart",
                        err)
            # the wait for the new group to load; its deaths are bounded by the launcher's
            # restart budget, which ends the launch (and this router) once spent
            deadline = _now() + max(config.shard_recovery_timeout, GROUP_START_WAIT)
        except BaseException:
            await client.close()
            raise


async def _connect(config: ModelSettings, deadline: float | None) -> ShardedClient:
    """A client of the group; with a deadline, retried until then while its shards start."""
    while True:
        try:
            return await ShardedClient.connect(config.master_shard_uds_path)
        except ShardError:
            if deadline is None or _now() > deadline:
                raise
            await asyncio.sleep(0.5)


async def _build(config: ModelSettings, client: ShardedClient,
                 adapter_links: AdapterLinks) -> ServedModel:
    tokenizer = RouterTokenizer(config.tokenizer_path, workers=config.validation_workers)
    await client.clear_cache()
    shard_info = await client.info()
    if shard_info.support_chunking and config.sets_join_rule():
        log.warning("the shards chunk prefills: --waiting-served-ratio and --max-waiting-tokens "
                    "are ignored (as in TGI); a new request's prefill carries the running "
                    "batch's step, and it joins as soon as it fits")
    limits = resolve_limits(config, shard_info)
    num_blocks = await warm_up(client, config, limits, shard_info.block_size)
    kv = kv_accounting(num_blocks, shard_info.block_size,
                       prefix_caching=config.prefix_caching == "on"
                       and shard_info.use_prefix_caching,
                       session_limits=config.session_limits())
    allocator = kv.allocator
    capacity = allocator.num_usable_blocks * allocator.block_size
    scheduling = SchedulingLimits(
        max_batch_prefill_tokens=limits.max_batch_prefill_tokens, max_batch_total_tokens=capacity,
        waiting_served_ratio=config.waiting_served_ratio,
        max_waiting_tokens=config.max_waiting_tokens, max_batch_size=config.max_batch_size,
        max_decode_steps=config.max_decode_steps_per_call,
        stream_decode_steps=shard_info.device_type == "cuda")
    # the metrics count requests by adapter from the batcher, made below: they are read only when
    # scraped, once the model serves
    batcher: Batcher | None = None
    metrics = Metrics(max_input_tokens=limits.max_input_tokens,
                      max_total_tokens=limits.max_total_tokens,
                      adapter_requests=lambda: batcher.requests_by_adapter())
    queue = RequestQueue(allocator, kv.prefix_cache, chunking=shard_info.support_chunking)
    served: ServedModel | None = None  # the recovery reloads its adapters once it exists

    async def reload_adapters() -> None:
        if served is not None:
            await served.adapters.reload_all()

    batcher = Batcher(client, queue, allocator, scheduling, metrics,
                      recovery_policy(client, config, limits, allocator, reload_adapters),
                      sessions=kv.sessions)
    infer = Infer(batcher, metrics, max_concurrent_requests=config.max_concurrent_requests,
                  grammar_support=not config.disable_grammar_support,
                  generates=shard_info.generates)
    validation_limits = ValidationLimits(limits, config.max_best_of, config.max_stop_sequences,
                                         config.max_top_n_tokens, shard_info.vocab_size)
    images = image_family(config.tokenizer_path, tokenizer.tokenizer.id_to_token)
    sessions = RequestSessions(kv.sessions, infer, tokenizer, limits,
                               refresh_gauges=batcher.running.update_gauges, images=images)
    served = ServedModel(config, tokenizer, client, shard_info, limits, validation_limits,
                         allocator, batcher, infer, metrics, chat_template(config),
                         sessions=sessions, adapter_links=adapter_links, images=images)
    return served


def chat_template(config: ModelSettings) -> ChatTemplate | None:
    """The model's chat template.

    One that does not compile is said once here, and the chat routes answer its error as a 422:
    the rest of the API serves the model all the same.
    """
    template = ChatTemplate.from_model_dir(config.tokenizer_path, config.tokenizer_config_path)
    if template is not None and template.error is not None:
        log.warning("%s: %s; the chat routes answer 422 until the template is fixed, the other "
                    "routes serve", config.model_id or config.tokenizer_path, template.error)
    return template
