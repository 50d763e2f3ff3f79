"""request_id sessions of /api/generate-one|batch, from a call's begin to its end, and their expiry.

A call holds its ids' sessions (router.kv.sessions keeps them, with the KV blocks they hold) for
its duration: the first call on an id generates from its prompt; a later one ignores its prompt and
continues from every token so far, the blocks the session kept standing in for their prefill, with
the LoRA adapter the session started with. What a call generated joins its session only once the
client got all of it. A session is keyed by the caller's identity and the id, so one client never
continues, or reads, another's text. Sessions idle past the TTL let go of their blocks (expire_every,
one of the served model's tasks).
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field

from router.core.generation import Continuation, GenerateResult, Infer
from router.errors import SessionBusyError, ValidationError
from router.inputs.generation_config import GenerationConfig
from router.inputs.images.family import ImageFamily
from router.inputs.images.placement import markdown_prompt, placed
from router.inputs.images.sources import MediaLimits
from router.inputs.tokenizer import RouterTokenizer
from router.inputs.validation import TokenLimits, check_lengths
from router.kv.sessions import Session, SessionAdapterConflict, SessionBusy, SessionKey, SessionStore
from router.scheduler.active_request import ActiveRequest
from router.schemas import FinalInfo, GenerateRequest, StoppingParams, TokenEvent


@dataclass(eq=False)
class SessionCall:
    """One call's hold on its sessions: each one's core request, and what it held before the call."""

    owner: RequestSessions
    sessions: list[Session]
    requests: list[GenerateRequest] = field(default_factory=list)
    succeeded: bool = False  # the client got everything: the sessions keep what was generated

    def before(self, index: int, *, only_new_tokens: bool) -> str:
        """What precedes the new text in an answer: nothing, or the prompt and all generated before.

        A session's text changes only when the call ends.
        """
        session = self.sessions[index]
        return "" if only_new_tokens else session.prompt + session.text

    async def stream(self) -> AsyncIterator[TokenEvent]:
        """The events of a call on one session; it succeeds once its final event was taken."""
        (session,), (request,) = self.sessions, self.requests
        infer = self.owner.infer
        async with aclosing(infer.stream(request, continuation=self.owner.continuation(
                session, request))) as events:
            async for event in events:
                yield event
                if event.final is not None:
                    self.succeeded = True

    async def generate(self) -> list[GenerateResult]:
        """Every session's result, in order; the call succeeds when all of them do."""
        infer, owner = self.owner.infer, self.owner
        continuations = [owner.continuation(s, r) for s, r in zip(self.sessions, self.requests)]
        if len(self.requests) == 1:
            results = [await infer.generate(self.requests[0], continuation=continuations[0])]
        else:  # the items run at once inside continuous batching; one failure fails the call
            results = await infer.generate_many(self.requests, continuations=continuations)
        self.succeeded = True
        return results


class RequestSessions:
    """The request_id sessions of one served model: begin, the adapter check, end, expiry."""

    def __init__(self, store: SessionStore, infer: Infer, tokenizer: RouterTokenizer,
                 limits: TokenLimits, *, refresh_gauges: Callable[[], None],
                 images: ImageFamily | None = None):
        self.store = store
        self.images = images  # the model's image family: a prompt's `![](url)` are images
        self.infer = infer
        self.tokenizer = tokenizer
        self.limits = limits
        # the KV and session gauges, once expiry let go of blocks
        self.refresh_gauges = refresh_gauges

    @asynccontextmanager
    async def call(self, who: str, prompts: list[tuple[str, str]], config: GenerationConfig,
                   media: MediaLimits = MediaLimits()) -> AsyncIterator[SessionCall]:
        """A call on the sessions of `prompts` ((request_id, prompt) pairs) for the caller `who`.

        Each session is held (a 409 while another call holds it) and its core request made (a 422
        for a continuation too long, or that names another adapter; a first call's images are
        read within `media`); on exit, each keeps what the call generated when it succeeded.
        """
        call = SessionCall(self, [])
        try:
            for request_id, prompt in prompts:
                call.sessions.append(self.begin((who, request_id), prompt))
            for session in call.sessions:
                call.requests.append(
                    await self.infer.count_request(self.core_request(session, config, media)))
            yield call
        finally:
            for session in call.sessions:
                self.end(session, call.succeeded)

    def begin(self, key: SessionKey, prompt: str) -> Session:
        """The session of `key`, held until end(); a 409 while another call holds it."""
        try:
            return self.store.begin(key, prompt)
        except SessionBusy:
            raise SessionBusyError(f"a call on request_id {key[1]!r} is still running") from None

    def adapter_for(self, session: Session, asked: str | None, *,
                    named: bool | None = None) -> str | None:
        """The LoRA adapter a call on `session` runs with ("" is None: the base model).

        A new session's is `asked`, which must be loaded; a started one keeps its own, and a call
        that names another (`named`: it gave the field; by default, whether `asked` is set) is a
        422.
        """
        asked = asked or None
        named = asked is not None if named is None else named
        try:
            adapter = session.adapter_for(asked, named=named)
        except SessionAdapterConflict:
            started = (f"adapter {session.adapter_id!r}" if session.adapter_id is not None
                       else "the base model (no adapter)")
            raise ValidationError(
                f"request_id {session.key[1]!r} was started with {started}; a call cannot "
                "change its adapter: leave adapter_id out, or start a new request_id") from None
        if adapter is not None:
            self.infer.adapters.check(adapter)
        return adapter

    async def core_request(self, session: Session, config: GenerationConfig,
                           media: MediaLimits = MediaLimits()) -> GenerateRequest:
        """The core request of one call: the prompt, or on a continuation every token so far.

        It runs with the session's LoRA adapter (its KV blocks were computed with it: a
        continuation that names another is a 422).
        """
        # "" names the base model: on a session started with an adapter, that is another adapter
        adapter_id = self.adapter_for(session, config.adapter_id,
                                      named=config.adapter_id is not None)
        max_input_tokens = self.limits.max_input_tokens
        images = session.images
        if session.started:
            input_ids, inputs = session.token_ids, session.prompt + session.text
            if len(input_ids) > max_input_tokens:
                raise ValidationError(
                    f"request_id {session.key[1]!r} holds {len(input_ids)} tokens, more than the "
                    f"{max_input_tokens} a call may start from: it cannot be continued; "
                    "start again under a new request_id")
        else:
            text, loaded = session.prompt, []
            if self.images is not None:
                text, loaded = await markdown_prompt(text, self.images, media, "`prompt`")
            input_ids = await self.tokenizer.encode_async(text, max_tokens=max_input_tokens)
            images = placed(input_ids, self.images, loaded) if loaded else []
            inputs = session.prompt
            if not input_ids:
                raise ValidationError("`prompt` cannot be empty")
        max_new_tokens = check_lengths(len(input_ids), config.max_new_tokens, self.limits)
        return GenerateRequest(inputs=inputs, input_ids=list(input_ids),
                               sampling=config.sampling(),
                               stopping=StoppingParams(max_new_tokens=max_new_tokens),
                               num_beams=config.num_beams, length_penalty=config.length_penalty,
                               adapter_id=adapter_id, images=images)

    def continuation(self, session: Session, request: GenerateRequest) -> Continuation:
        """How `request` continues `session` and leaves its result there.

        The blocks the session holds stand in for the prefill of its tokens (read when the request
        is planned); at the end the session keeps the new ones, pending the call's success.
        """
        store = self.store

        def keep(item: ActiveRequest, final: FinalInfo) -> None:
            # the best beam's keys and values need not be in the blocks any more: none are kept
            blocks = item.allocation.block_ids if item.request.num_beams == 1 else []
            store.keep(session, item.request.input_ids + item.generated_ids, final.text,
                       blocks, adapter_id=item.adapter_id, images=item.request.images)

        held = session if session.token_ids == request.input_ids else None
        return Continuation(held_prefix=held, on_final=keep)

    def end(self, session: Session, succeeded: bool) -> None:
        """Lets go of a session; it keeps the call's text only when the call `succeeded`."""
        self.store.end(session, succeeded)

    def expire(self) -> None:
        """Sessions idle past their TTL let go of their blocks."""
        self.store.expire()
        self.refresh_gauges()

    async def expire_every(self, period: float) -> None:
        """Expires idle sessions every `period` seconds, until cancelled."""
        while True:
            await asyncio.sleep(period)
            self.expire()
