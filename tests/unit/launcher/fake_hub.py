"""A Hugging Face Hub repository held in a local directory, behind the huggingface_hub entry points
the launcher calls (hf_hub_download, snapshot_download, HfApi), which record what they were asked.
The Hub cannot be reached from the test machines; this answers as it would."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

from safetensors.torch import load_file, save_file

from shard.checkpoint_files import INDEX_NAME

SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def write_sharded(model_dir: Path, out: Path, *, consolidated: bool = True) -> Path:
    """`model_dir` as Mistral's repositories ship it: its tensors in two HF shards named by an
    index and, with `consolidated`, all of them again in a consolidated.safetensors."""
    shutil.copytree(model_dir, out)
    tensors = load_file(out / "model.safetensors")
    (out / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = (names[:len(names) // 2], names[len(names) // 2:])
    for file_name, part in zip(SHARDS, halves):
        save_file({name: tensors[name] for name in part}, out / file_name,
                  metadata={"format": "pt"})
    weight_map = {name: file_name for file_name, part in zip(SHARDS, halves) for name in part}
    (out / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    if consolidated:
        save_file(tensors, out / "consolidated.safetensors", metadata={"format": "pt"})
    return out


class FakeHub:
    def __init__(self, monkeypatch, repo: Path, out: Path):
        import httpx2  # huggingface_hub's HTTP client: its errors carry a response
        import huggingface_hub
        from huggingface_hub.errors import RemoteEntryNotFoundError
        from huggingface_hub.utils import filter_repo_objects

        self.repo, self.calls = Path(repo), []
        hub = self

        def hf_hub_download(repo_id, filename, **kwargs):
            hub.calls.append(("hf_hub_download", repo_id, filename, kwargs))
            if not (hub.repo / filename).is_file():
                url = f"https://huggingface.co/{repo_id}/resolve/main/{filename}"
                raise RemoteEntryNotFoundError(f"{filename} is not in {repo_id}", response=(
                    httpx2.Response(404, request=httpx2.Request("HEAD", url))))
            return str(hub.repo / filename)

        def snapshot_download(repo_id, **kwargs):
            hub.calls.append(("snapshot_download", repo_id, kwargs))
            dest = Path(kwargs.get("local_dir") or out / "snapshot")
            for name in filter_repo_objects(hub.files(), allow_patterns=kwargs["allow_patterns"]):
                (dest / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(hub.repo / name, dest / name)
            return str(dest)

        class HfApi:
            def list_repo_files(self, repo_id, **kwargs):
                hub.calls.append(("list_repo_files", repo_id, kwargs))
                return hub.files()

            def list_repo_tree(self, repo_id, **kwargs):
                hub.calls.append(("list_repo_tree", repo_id, kwargs))
                return [SimpleNamespace(path=name, size=(hub.repo / name).stat().st_size)
                        for name in hub.files() if "/" not in name]

            def model_info(self, repo_id, **kwargs):
                hub.calls.append(("model_info", repo_id, kwargs))
                return SimpleNamespace(siblings=[
                    SimpleNamespace(rfilename=name, size=(hub.repo / name).stat().st_size)
                    for name in hub.files()])

        monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
        monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
        monkeypatch.setattr(huggingface_hub, "HfApi", HfApi)

    def files(self) -> list[str]:
        return sorted(p.relative_to(self.repo).as_posix() for p in self.repo.rglob("*")
                      if p.is_file())

    def called(self, name: str) -> list[tuple]:
        return [call[1:] for call in self.calls if call[0] == name]

    def allowed(self) -> list[str]:
        ((_, kwargs),) = self.called("snapshot_download")
        return kwargs["allow_patterns"]
