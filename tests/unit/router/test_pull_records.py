"""POST /v1/models/pull's router side over a scripted model host: a local path outside the allowed
directories refused at once, the same whatever lies there, and failed pulls forgotten past a bound."""
import json

import pytest

from router.errors import LocalPathRefusedError
from router.lifecycle.local_paths import REFUSAL, LocalRoots
from router.lifecycle.model_host import ModelHostError
from router.lifecycle.pulls import ModelPulls
from router.lifecycle.registry import (DOWNLOADED, MAX_FAILED_PULLS, NOT_DOWNLOADED, STOPPED,
                                       ModelRecord, ModelRegistry)
from tests.waiting import wait_until_async


class FailingHost:
    """A model host whose every pull fails, as a missing Hub repository's does."""

    def __init__(self):
        self.sources = []

    async def pull(self, source, target_dir, **_):
        self.sources.append(source)
        raise ModelHostError(f"{source!r} is no model: " + "why " * 50)
        yield  # an async generator, as the real one


def _pull(pulls: ModelPulls, source: str, model_id: str | None = None):
    body = {"model": source} if model_id is None else {"model": source, "id": model_id}
    return pulls.pull(body, refuse_id=lambda _: None, running=())


async def test_a_path_outside_the_allowed_directories_is_refused_alike(tmp_path):
    allowed = tmp_path / "allowed"
    (allowed / "m").mkdir(parents=True)
    (tmp_path / "allowed-evil").mkdir()
    (allowed / "link").symlink_to(tmp_path / "allowed-evil")
    host = FailingHost()
    pulls = ModelPulls(ModelRegistry(tmp_path / "registry"), host,
                       local_roots=LocalRoots.of([allowed]))
    for source in (str(tmp_path / "allowed-evil"), str(tmp_path / "nothing-here"),
                   f"{allowed}/../allowed-evil", str(allowed / "link"), "/etc", "~/x",
                   "../../etc/passwd", "./x", "stolen.gguf"):
        with pytest.raises(LocalPathRefusedError) as err:
            _pull(pulls, source, "x")
        assert (err.value.status, str(err.value)) == (403, REFUSAL), source
    assert pulls.registry.records == {} and host.sources == []
    _pull(pulls, str(allowed / "m"), "inside")  # inside, and names that are no path, go on
    _pull(pulls, "org/hub-model")
    await wait_until_async(lambda: not pulls.tasks, "the pulls to end")
    assert host.sources == [str(allowed / "m"), "org/hub-model"]


async def test_failed_pulls_are_forgotten_past_the_bound(tmp_path):
    registry = ModelRegistry(tmp_path)
    registry.add(ModelRecord("kept", DOWNLOADED))
    registry.add(ModelRecord("stopped", STOPPED))
    pulls = ModelPulls(registry, FailingHost(), local_roots=LocalRoots())
    for number in range(MAX_FAILED_PULLS * 3):
        _pull(pulls, f"org/missing-{number}")
        if number % 4 == 3:  # MAX_PULLS at a time
            await wait_until_async(lambda: not pulls.tasks, "the pulls to end")
    await wait_until_async(lambda: not pulls.tasks, "the pulls to end")
    failed = [r.id for r in registry.records.values() if r.state == NOT_DOWNLOADED]
    assert len(failed) == MAX_FAILED_PULLS
    assert "org/missing-0" not in failed and f"org/missing-{MAX_FAILED_PULLS * 3 - 1}" in failed
    assert {"kept", "stopped"} <= set(registry.records)  # only failures are forgotten
    saved = json.loads((tmp_path / "models.json").read_text())["models"]
    assert {m["id"] for m in saved} == set(registry.records)
    # an older registry's failures are trimmed when it is read
    registry.close()
    for number in range(40):
        saved.append({**saved[-1], "id": f"old-{number}", "created": 1})
    (tmp_path / "models.json").write_text(json.dumps({"version": 1, "models": saved}))
    again = ModelRegistry(tmp_path)
    assert sum(r.state == NOT_DOWNLOADED for r in again.records.values()) == MAX_FAILED_PULLS
    assert not any(name.startswith("old-") for name in again.records)
