"""Admission and the per-request event stream: 429 past the concurrency limit, cancellation on exit."""
from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from router.batcher import ActiveRequest, Batcher
from router.errors import IncompleteGenerationError, OverloadedError, RouterError, ValidationError
from router.request_queue import QueueEntry
from router.schemas import FinalInfo, GenerateRequest, Token, TokenEvent


@dataclass(slots=True)
class GenerateResult:
    tokens: list[Token] = field(default_factory=list)
    top_tokens: list[list[Token]] = field(default_factory=list)
    prefill: list[Token] = field(default_factory=list)
    final: FinalInfo | None = None


class Infer:
    def __init__(self, batcher: Batcher, *, max_concurrent_requests: int):
        self.batcher = batcher
        self.max_concurrent_requests = max_concurrent_requests
        self.in_flight = 0
        self._ids = itertools.count()

    def _admit(self, request: GenerateRequest) -> ActiveRequest:
        if self.in_flight >= self.max_concurrent_requests:
            raise OverloadedError()
        entry = QueueEntry(id=next(self._ids), input_length=request.input_length,
                           max_new_tokens=request.stopping.max_new_tokens)
        allocator = self.batcher.allocator
        if allocator.blocks_needed(entry.kv_tokens) > allocator.num_usable_blocks:
            raise ValidationError(f"the request needs {entry.kv_tokens} tokens of KV cache but the "
                                  f"server holds {allocator.num_usable_blocks * allocator.block_size}")
        item = ActiveRequest(entry=entry, request=request)
        entry.payload = item
        return item

    async def stream(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        """Events of one request; leaving the iteration early cancels it and frees what it held."""
        item = self._admit(request)
        self.in_flight += 1
        try:
            self.batcher.submit(item)
            while True:
                event = await item.events.get()
                if isinstance(event, RouterError):
                    raise event
                yield event
                if event.final is not None:
                    return
        finally:
            if not item.is_done:
                self.batcher.cancel(item)
            self.in_flight -= 1

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        result = GenerateResult()
        async for event in self.stream(request):
            result.tokens.append(event.token)
            result.top_tokens.append(event.top_tokens)
            if event.prefill is not None:
                result.prefill = event.prefill
            if event.final is not None:
                result.final = event.final
        if result.final is None:
            raise IncompleteGenerationError()
        return result
