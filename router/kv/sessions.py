"""Sessions of /api/generate-one|batch: a request_id's tokens, and the KV blocks that hold them.

They are kept after its generation so that the id's next call continues without computing them
again.

A session holds one reference to each block covering its computed tokens (all but the last generated
one, whose keys and values are computed by the next call). Sessions together hold at most a share of
the pool; past it, when the pool runs short, or once idle past the TTL, the least recently used idle
session lets go of its blocks. A session without blocks keeps its tokens: its next call computes
them again (the same answer, later). Past `max_sessions`, once a call ends with its session kept,
the least recently used idle session is forgotten. A session keeps the LoRA adapter its generation
ran with: its keys and values are that adapter's, so a later call continues with it and may not name
another (SessionAdapterConflict). A session keeps its prompt's images over their tokens too: a later
call, continuing from its tokens, sends them again with their spans (the image tokens alone say
nothing of which image they were). Pure: no I/O. The call's side of a session is
router/lifecycle/sessions.py.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from router.kv.block_allocator import BlockPool
from router.schemas import PromptImage

SessionKey = tuple[str, str]  # (who: a digest of the caller's API key, or "", request_id)


@dataclass(frozen=True, slots=True)
class SessionLimits:
    max_sessions: int = 1024  # sessions remembered (tokens and text), blocks or not
    kv_share: float = 0.5  # share of the KV pool that sessions may hold together
    ttl: float = 600.0  # seconds a session keeps its blocks once idle


class SessionBusy(Exception):
    """A call on this request_id is still running."""


class SessionAdapterConflict(Exception):
    """A call names another LoRA adapter than the one its session's generation ran with."""


@dataclass(eq=False, slots=True)
class Session:
    key: SessionKey
    prompt: str  # the first call's prompt, as the client sent it
    text: str = ""  # everything generated so far
    token_ids: list[int] = field(default_factory=list)  # the prompt's and every generated id
    blocks: list[int] = field(default_factory=list)  # hold the KV of token_ids[:computed]
    computed: int = 0
    last_used: float = 0.0
    busy: bool = False  # a call runs on it: no other call may take it
    adapter_id: str | None = None  # the LoRA adapter its generation ran with (None: the base)
    images: list[PromptImage] = field(default_factory=list)  # its prompt's, over their tokens
    # what the running call's generation left, applied when the call succeeds (end): until
    # then the session is as it was, so a call that fails afterwards changes nothing
    pending: Session | None = None

    @property
    def started(self) -> bool:
        """Whether a generation ran (a later call continues it; the prompt is then ignored)."""
        return bool(self.token_ids)

    def adapter_for(self, asked: str | None, *, named: bool) -> str | None:
        """The adapter a call runs with: `asked` when the session has not started, else its own.

        A call that `named` an adapter (`asked`, None for the base model) must repeat the
        session's own (SessionAdapterConflict otherwise).
        """
        if not self.started:
            return asked
        if named and asked != self.adapter_id:
            raise SessionAdapterConflict(self.adapter_id)
        return self.adapter_id


class SessionStore:
    def __init__(self, pool: BlockPool, limits: SessionLimits = SessionLimits(), *,
                 clock: Callable[[], float] = time.monotonic):
        self.pool = pool
        self.max_sessions = limits.max_sessions
        self.kv_share = limits.kv_share
        self.ttl = limits.ttl
        self.clock = clock
        self._sessions: OrderedDict[SessionKey, Session] = OrderedDict()  # least recent first
        self.held_blocks = 0  # blocks the sessions hold (pending results included)

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, key: SessionKey) -> Session | None:
        return self._sessions.get(key)

    def begin(self, key: SessionKey, prompt: str) -> Session:
        """The session of `key` for one call (a new one when unknown), marked busy until end()."""
        session = self._sessions.get(key)
        if session is not None and session.busy:
            raise SessionBusy(key[1])
        if session is None:
            session = Session(key, prompt)
            self._sessions[key] = session
        session.busy = True
        session.last_used = self.clock()
        self._sessions.move_to_end(key)
        # past max_sessions the oldest is forgotten by end(), once this call has succeeded: a
        # call refused after begin() (a 422, a 429) must cost no other client its session
        return session

    @property
    def max_blocks(self) -> int:
        return int(self.kv_share * self.pool.num_usable_blocks)  # the pool may be resized

    def end(self, session: Session, succeeded: bool) -> None:
        """The call is over: what it generated becomes the session's if the client got it all.

        Unless it `succeeded`, the session stays as it was before the call.
        """
        pending, session.pending = session.pending, None
        if pending is not None:
            if succeeded:
                self._release(session.blocks)
                session.token_ids, session.blocks = pending.token_ids, pending.blocks
                session.computed, session.text = pending.computed, pending.text
                session.adapter_id, session.images = pending.adapter_id, pending.images
            else:
                self._release(pending.blocks)
        session.busy = False
        session.last_used = self.clock()
        if session.key in self._sessions:
            self._sessions.move_to_end(session.key)
        if not session.started:  # nothing ran (the call failed first): nothing to continue
            self._forget(session)
            return
        if succeeded:  # a refused or failed call forgets nobody's session
            self._forget_beyond_limit()
        self._fit_budget()

    def keep(self, session: Session, token_ids: list[int], added_text: str,
             block_ids: list[int], *, adapter_id: str | None = None,
             images: list[PromptImage] | None = None) -> None:
        """A call's generation finished: its tokens and blocks are kept, pending the call's end.

        `token_ids` (the history and the new ids) and the blocks holding them (not those
        past the computed tokens), computed with `adapter_id` and `images`, become the
        session's if the call succeeds (end).
        """
        computed = len(token_ids) - 1
        kept = block_ids[:self.pool.blocks_needed(computed)]
        self.pool.incref(kept)
        self.held_blocks += len(kept)
        if session.pending is not None:
            self._release(session.pending.blocks)
        session.pending = Session(session.key, session.prompt, session.text + added_text,
                                  list(token_ids), kept, computed, adapter_id=adapter_id,
                                  images=list(images or []))

    def release_blocks(self, needed: int) -> int:
        """Sessions let go of blocks until `needed` are free again; returns how many became free.

        Least recently used first and idle ones before busy ones, until none is left (the
        allocator's reclaimer). A busy session's call, waiting, then computes its tokens
        again; running, it holds the blocks it needs itself.
        """
        freed = 0
        for busy in (False, True):
            for session in list(self._sessions.values()):
                if freed >= needed:
                    return freed
                if session.busy == busy and session.blocks:
                    freed += self._drop_blocks(session)
        return freed

    def expire(self) -> None:
        """Sessions idle past the TTL let go of their blocks."""
        deadline = self.clock() - self.ttl
        for session in list(self._sessions.values()):
            if session.last_used > deadline:
                break  # ordered by last use: the rest are more recent
            if not session.busy and session.blocks:
                self._drop_blocks(session)

    def release_adapter(self, adapter_id: str) -> None:
        """Sessions of `adapter_id` let go of their blocks.

        It is unloaded (no request on it is queued or running), and an adapter loaded later
        under its name would compute other keys and values. Their tokens stay: a next call
        computes them again, if the name is loaded again by then.
        """
        for session in list(self._sessions.values()):
            if session.adapter_id == adapter_id and session.blocks:
                self._drop_blocks(session)

    def clear_blocks(self) -> None:
        """Forgets every block without letting go of them: for a pool about to be reset."""
        for session in self._sessions.values():
            session.blocks, session.computed = [], 0
            if session.pending is not None:
                session.pending.blocks, session.pending.computed = [], 0
        self.held_blocks = 0

    # ---- internals ----------------------------------------------------------------------------

    def _release(self, blocks: list[int]) -> None:
        self.pool.decref(blocks)
        self.held_blocks -= len(blocks)

    def _drop_blocks(self, session: Session) -> int:
        before = self.pool.num_free_blocks
        self._release(session.blocks)
        session.blocks, session.computed = [], 0
        return self.pool.num_free_blocks - before

    def _fit_budget(self) -> None:
        for session in list(self._sessions.values()):
            if self.held_blocks <= self.max_blocks:
                return
            if not session.busy and session.blocks:
                self._drop_blocks(session)

    def _forget(self, session: Session) -> None:
        self._release(session.blocks)
        session.blocks = []
        self._sessions.pop(session.key, None)

    def _forget_beyond_limit(self) -> None:
        for session in list(self._sessions.values()):
            if len(self._sessions) <= self.max_sessions:
                return
            if not session.busy:
                self._forget(session)
