"""Ollama's keep_alive: a stopped model a request names starts, and one idle past its time stops.

As Ollama: a request's `keep_alive` (seconds, or a Go duration such as "5m"; negative: for ever;
0: stop once the request is done) sets how long its model stays running once idle. A model an
Ollama request started gets Ollama's 5 minutes unless a request says otherwise; the others keep
running until a request gives them a keep_alive. Requests may start models only while fewer than
--ollama-autostart models run (0: never; the request gets the 409 saying how to start it).
"""
from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass, field

from aiohttp import web

from router.errors import RouterError, ValidationError
from router.lifecycle.registry import DOWNLOADED, STOPPED
from router.lifecycle.served_model import ServedModel
from router.state import STATE, RouterState, model_and_adapter

log = logging.getLogger("tgi.router")

DEFAULT_S = 300.0  # Ollama's OLLAMA_KEEP_ALIVE default, for the models its requests start
CHECK_S = 0.5  # how often idle models are looked at
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")


def seconds(value) -> float | None:
    """`keep_alive` in seconds: None when not given, a negative number for ever."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        text = text.lstrip("+-")
        try:
            return sign * float(text)  # a bare number: seconds
        except ValueError:
            pass
        parts = _PART.findall(text)
        if parts and "".join(n + u for n, u in parts) == text:
            return sign * sum(float(n) * _UNITS[u] for n, u in parts)
    raise ValidationError("`keep_alive` must be a number of seconds or a duration such as "
                          "\"5m\", \"1h30m\" (negative: keep the model running; 0: stop it "
                          "after this request)")


@dataclass
class KeepAlive:
    """When each model is stopped once idle, and which models Ollama requests started."""

    deadlines: dict[str, float] = field(default_factory=dict)  # model id -> monotonic time
    started: set[str] = field(default_factory=set)
    loading: dict[str, float] = field(default_factory=dict)  # model id -> seconds its start took

    def touch(self, state: RouterState, model_id: str, keep: float | None) -> None:
        """A request of `model_id` asked for `keep` seconds (None: as before)."""
        if keep is None:
            keep = DEFAULT_S if model_id in self.started else None
            if keep is None:
                return
        if keep < 0:
            self.deadlines.pop(model_id, None)
            return
        if model_id not in state.models.registry.records:
            raise ValidationError(f"`keep_alive` {keep:g} s cannot apply to model {model_id!r}: "
                                  "it is served from a path, without a registry id, and cannot "
                                  "be stopped (leave keep_alive out, or give -1)")
        self.deadlines[model_id] = time.monotonic() + keep

    def expires_at(self, model_id: str) -> float | None:
        """The wall-clock time the model stops at if idle until then; None: never."""
        deadline = self.deadlines.get(model_id)
        return None if deadline is None else time.time() + (deadline - time.monotonic())


KEEP_ALIVE = web.AppKey("ollama_keep_alive", KeepAlive)


async def model_for(request: web.Request, name) -> tuple[ServedModel, str | None]:
    """The running model (and LoRA adapter) `name` names, started first where the flag allows."""
    if name is not None and not isinstance(name, str):
        raise ValidationError("`model` must be a string")
    state, keep = request.app[STATE], request.app[KEEP_ALIVE]
    name = resolved(state, name)
    record = state.models.registry.records.get(name) if name else None
    if record is not None and name not in state.models.served and record.state in (
            STOPPED, DOWNLOADED) and len(state.models.served) < state.config.ollama_autostart:
        began = time.monotonic()
        await state.models.start(name)
        keep.started.add(name)
        keep.loading[name] = time.monotonic() - began
    return model_and_adapter(request, name)


def resolved(state: RouterState, name: str | None) -> str | None:
    """Ollama's `name:latest` is the model `name` (this server's ids carry no tag)."""
    if name and name.endswith(":latest"):
        bare = name.removesuffix(":latest")
        if bare in state.models.served or bare in state.models.registry.records:
            return bare
    return name


async def stop_idle(state: RouterState, keep: KeepAlive, interval: float = CHECK_S) -> None:
    """Stops each model idle past its keep_alive; runs until the router stops."""
    while True:
        await asyncio.sleep(interval)
        now = time.monotonic()
        for model_id, deadline in list(keep.deadlines.items()):
            served = state.models.served.get(model_id)
            if served is None:
                keep.deadlines.pop(model_id, None)
                keep.started.discard(model_id)
                continue
            if now < deadline or not served.infer.is_idle:
                continue
            keep.deadlines.pop(model_id, None)
            keep.started.discard(model_id)
            try:
                await state.models.stop(model_id)
            except RouterError as err:
                log.warning("keep_alive: stopping %s: %s", model_id, err)
