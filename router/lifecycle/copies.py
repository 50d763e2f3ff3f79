"""Copies of a model under another id, as Ollama's /api/copy makes them.

A copy is a registry record of its own, stopped, with the source's settings and request defaults.
Its files are hard links to the source's under its own directory, so that it takes no space and
deleting either model leaves the other's files whole; a model whose files live outside the registry
(a local path pulled in place) is copied as a second record of the same files, which neither owns.
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import time
from pathlib import Path

from router.errors import ModelStateError
from router.lifecycle.registry import (DOWNLOADED, DOWNLOADING, RUNNING, SERVABLE, ModelRecord, ModelRegistry,
                                       check_model_id, directory_for)


async def copy_model(registry: ModelRegistry, source_id: str, destination_id: str, *,
                     running: bool = False) -> ModelRecord:
    """The copy of `source_id` as `destination_id`, added to `registry`.

    `running`: a model of that id runs (one served from a path has no record)."""
    record = registry.get(source_id)
    check_model_id(destination_id)
    if record.state not in (*SERVABLE, RUNNING):
        raise ModelStateError(f"model {source_id!r} cannot be copied: it is {record.state}",
                              record.state)
    existing = registry.records.get(destination_id)
    if existing is not None or running:
        raise ModelStateError(f"model {destination_id!r} already exists; delete it first",
                              existing.state if existing is not None else RUNNING)
    # the id is taken while the files are linked (DOWNLOADING: not started, not deleted), by a
    # record that owns no files until they are its own: one left by a crash meanwhile, deleted
    # later, must not take the source's with it
    linked = record.owned and registry.models_dir is not None
    copied = registry.add(dataclasses.replace(
        record, id=destination_id, state=DOWNLOADING, name=destination_id.rsplit("/", 1)[-1],
        model_dir=None if linked else record.model_dir, owned=False, created=int(time.time()),
        error=None, was_running=False, settings=dict(record.settings),
        parameters=dict(record.parameters), engine_parameters=dict(record.engine_parameters)))
    if linked:
        target = directory_for(registry.models_dir, destination_id)
        try:
            await asyncio.to_thread(_linked_tree, Path(record.model_dir), target)
        except BaseException as err:  # the source deleted meanwhile, a full disk, a cancel
            registry.remove(destination_id)
            shutil.rmtree(target, ignore_errors=True)
            if isinstance(err, OSError):
                raise ModelStateError(f"model {source_id!r} could not be copied: {err}",
                                      record.state) from None
            raise
        copied.model_dir, copied.owned = str(target), True
    copied.state = DOWNLOADED
    registry.save()
    return copied


def _linked_tree(source: Path, target: Path) -> None:
    """`source`'s files under `target`, hard-linked (copied where a link cannot be made)."""
    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    if target.exists():  # what an interrupted copy left
        shutil.rmtree(target, ignore_errors=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(source, target, copy_function=link, symlinks=True)
