"""The router's chat-template pool: worker processes that render within a time and memory budget.

A chat template is code from a model's files, and Python threads cannot be stopped: a template that
loops for minutes in the router's own threads held them from every other model's chats. Here each
render runs in a worker process (router/inputs/template_worker.py) under its RenderLimits: loop
steps and value sizes counted by the sandbox, its address space capped, and a deadline past which
the worker is killed and another started. A render over budget is its own request's 422.

So that one model's template never holds every worker, a template renders in at most all but one
of them at a time. A template that went over budget is remembered for FORGET_AFTER_S with the size
of the chat it failed on: a chat at least that large is refused at once (the same work would fail
again), while smaller ones are still tried, since a template's cost grows with its input.
"""
from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from router.errors import TemplateError, UnhealthyError
from router.inputs import template_worker as wire
from router.inputs.chat_template import ChatTemplate
from router.inputs.template_budget import RenderBudget, TemplateBudgetError

log = logging.getLogger("tgi.router.templates")

FORGET_AFTER_S = 60.0  # how long a template's failure to keep its budget is remembered
_START_TIMEOUT_S = 30.0  # a worker not ready by then is given up (and started again)
_RESTART_DELAY_S = 1.0  # between failed starts
_INLINE_BYTES = 256 << 10
_TIMED_OUT = b"T"  # the pool's own answer kind: the worker did not answer in time
# a template past its time is remembered only if its worker had at least this share of it on a
# CPU: otherwise the machine was busy, and the same chat may well render later
_BLAMED_CPU_SHARE = 0.5
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_ROOT = str(Path(__file__).resolve().parents[2])  # the directory holding the router package


@dataclass(frozen=True, slots=True)
class RenderLimits:
    """What one render may spend: RenderBudget's steps and sizes, wall time and memory."""

    budget: RenderBudget
    seconds: float = 2.0
    memory_bytes: int = 256 << 20

    @classmethod
    def for_payload(cls, payload_limit: int) -> "RenderLimits":
        """Limits that a chat of up to `payload_limit` bytes, rendered by a sane template, fits.

        A step for each byte the largest body holds; what it builds up to four times its size,
        and the memory for that with room to spare."""
        budget = RenderBudget(max_steps=max(1_000_000, payload_limit),
                              max_chars=max(8_000_000, 4 * payload_limit))
        return cls(budget, memory_bytes=(256 << 20) + 32 * payload_limit)


@dataclass(slots=True)
class _Failure:
    at: float  # monotonic time
    job_bytes: int  # the size of the chat it failed on
    message: str


class _Worker:
    def __init__(self, process: asyncio.subprocess.Process):
        self.process = process

    async def read(self) -> tuple[bytes, str]:
        header = await self.process.stdout.readexactly(4)
        payload = await self.process.stdout.readexactly(wire.decode_length(header))
        if len(payload) > _INLINE_BYTES:  # a prompt of megabytes is decoded off the event loop
            return payload[:1], await asyncio.to_thread(wire.answer_text, payload[1:])
        return payload[:1], wire.answer_text(payload[1:])

    async def exchange(self, job: bytes) -> tuple[bytes, str]:
        self.process.stdin.write(wire.frame(job))
        await self.process.stdin.drain()
        return await self.read()

    def cpu_seconds(self) -> float:
        """The CPU time the worker has used (0 where /proc cannot tell)."""
        try:
            with open(f"/proc/{self.process.pid}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime + stime
        except (OSError, IndexError, ValueError):
            return 0.0

    async def kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()
        await self.process.wait()


class TemplatePool:
    """`size` workers (at least 3), started at the first render or by start()."""

    def __init__(self, limits: RenderLimits, size: int = 3):
        self.limits = limits
        # one template may hold all workers but one: at least two for each model's chats
        self.size = max(3, size)
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._running: Counter[str] = Counter()  # renders under way, by template digest
        self._failures: dict[str, _Failure] = {}
        self._starting: set[asyncio.Task] = set()
        self._renders: set[asyncio.Task] = set()
        self._changed: asyncio.Condition | None = None
        self._closed = False
        self._start_error: str | None = None  # why the last worker start failed, until one starts

    def start(self) -> None:
        """Starts the workers, unless they are running or starting."""
        if self._changed is None:
            self._changed = asyncio.Condition()
            for _ in range(self.size):
                self._replace()

    async def render(self, template: ChatTemplate, job: bytes) -> str:
        """The prompt `template` renders from `job` (template_worker.encode_job's bytes).

        A TemplateError (422) when the template fails, or goes over budget."""
        if template.template is None:
            raise TemplateError(template.error)
        self._check_remembered(template.digest, len(job))
        self.start()
        async with self._changed:
            await self._changed.wait_for(
                lambda: self._may_start(template.digest) or self._cannot_start())
            if not self._may_start(template.digest):
                raise UnhealthyError(f"chat templates cannot be rendered now: no template worker "
                                     f"process starts ({self._start_error})")
            # it may have failed on another chat while this one waited
            self._check_remembered(template.digest, len(job))
            worker = self._idle.pop()
            self._busy.add(worker)
            self._running[template.digest] += 1
        # the render goes on when its client leaves: its worker is free only once it answered
        task = asyncio.create_task(self._render(worker, template.digest, job))
        self._renders.add(task)
        task.add_done_callback(self._rendered)
        return await asyncio.shield(task)

    async def close(self) -> None:
        self._closed = True
        for task in [*self._starting, *self._renders]:
            task.cancel()
        await asyncio.gather(*self._starting, *self._renders, return_exceptions=True)
        workers, self._idle = [*self._idle, *self._busy], []
        await asyncio.gather(*(w.kill() for w in workers), return_exceptions=True)

    def _rendered(self, task: asyncio.Task) -> None:
        self._renders.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a render whose client left has nobody to hear it

    def _may_start(self, digest: str) -> bool:
        return bool(self._idle) and self._running[digest] < self.size - 1

    def _cannot_start(self) -> bool:
        """Whether no worker runs and the last start failed: a wait for one has no bound."""
        return self._start_error is not None and not self._idle and not self._busy

    def _check_remembered(self, digest: str, job_bytes: int) -> None:
        failure = self._failures.get(digest)
        if failure is None:
            return
        ago = time.monotonic() - failure.at
        if ago > FORGET_AFTER_S:
            del self._failures[digest]
        elif job_bytes >= failure.job_bytes:
            raise TemplateBudgetError(f"{failure.message} (on a chat as large {ago:.0f} s ago: "
                                      f"such chats are refused without rendering for "
                                      f"{FORGET_AFTER_S:.0f} s)")

    def _remember(self, digest: str, job_bytes: int, message: str) -> None:
        """A failure to keep the budget, on a chat of `job_bytes`: the smallest such is kept."""
        now, earlier = time.monotonic(), self._failures.get(digest)
        if earlier is not None and now - earlier.at <= FORGET_AFTER_S:
            job_bytes = min(job_bytes, earlier.job_bytes)
        self._failures[digest] = _Failure(now, job_bytes, message)

    async def _render(self, worker: _Worker, digest: str, job: bytes) -> str:
        is_fit = False
        try:
            cpu_before = worker.cpu_seconds()
            kind, text, is_fit = await self._exchange(worker, job)
            if kind == wire.PROMPT:
                return text
            if kind == wire.ERROR:
                raise TemplateError(text)
            # past its time for want of CPU (a busy machine: the workers run at a low priority),
            # the template is not to blame: later chats are still tried
            spent = worker.cpu_seconds() - cpu_before
            if kind != _TIMED_OUT or spent >= _BLAMED_CPU_SHARE * self.limits.seconds:
                self._remember(digest, len(job), text)
            raise TemplateBudgetError(text)
        finally:
            await self._release(worker, digest, is_fit)

    async def _exchange(self, worker: _Worker, job: bytes) -> tuple[bytes, str, bool]:
        """The worker's answer (kind, text), and whether the worker may render again."""
        try:
            kind, text = await asyncio.wait_for(worker.exchange(job), self.limits.seconds)
        except asyncio.TimeoutError:  # still rendering: only killing it stops it
            return _TIMED_OUT, (f"the chat template did not render within its "
                                      f"{self.limits.seconds:g} s"), False
        except (OSError, asyncio.IncompleteReadError) as err:
            log.warning("a chat-template worker died while rendering: %r", err)
            return wire.OUT_OF_MEMORY, ("the chat template's render ended its worker process "
                                        "(out of memory, or a crash)"), False
        return kind, text, kind != wire.OUT_OF_MEMORY  # (which the worker exits after)

    async def _release(self, worker: _Worker, digest: str, is_fit: bool) -> None:
        if not is_fit:
            await worker.kill()
            if not self._closed:
                self._replace()
        async with self._changed:
            self._busy.discard(worker)
            self._running[digest] -= 1
            if self._running[digest] <= 0:
                del self._running[digest]
            if is_fit:
                self._idle.append(worker)
            self._changed.notify_all()

    def _replace(self) -> None:
        task = asyncio.create_task(self._start_worker())
        self._starting.add(task)
        task.add_done_callback(self._starting.discard)

    async def _start_worker(self) -> None:
        while True:
            try:
                worker = await asyncio.wait_for(self._spawn(), _START_TIMEOUT_S)
                break
            except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError) as err:
                log.error("could not start a chat-template worker: %r; trying again", err)
                async with self._changed:  # chats waiting with no worker left are answered
                    self._start_error = repr(err)
                    self._changed.notify_all()
                await asyncio.sleep(_RESTART_DELAY_S)
        async with self._changed:
            self._start_error = None
            self._idle.append(worker)
            self._changed.notify_all()

    async def _spawn(self) -> _Worker:
        limits = self.limits
        path = os.environ.get("PYTHONPATH")
        env = {**os.environ, "PYTHONPATH": _ROOT + (os.pathsep + path if path else "")}
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "router.inputs.template_worker", str(limits.budget.max_steps),
            str(limits.budget.max_chars), str(limits.memory_bytes),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env)
        worker = _Worker(process)
        try:
            kind, _ = await worker.read()
            if kind != wire.READY:
                raise ValueError(f"a chat-template worker began with {kind!r}")
        except BaseException:
            await worker.kill()
            raise
        return worker
