"""Where the model host's pulls may read local files, and what the router is told of it.

The directories --allowed-local-model-path names, the launcher's model cache and the model
registry, and the model the launcher was started with, as the operator named it
(router/lifecycle/local_paths.py has the rule).
"""
from __future__ import annotations

from pathlib import Path

from launcher.config import LauncherConfig
from launcher.model_cache import cache_root
from router.lifecycle.local_paths import LocalRoots, is_path_like, split_paths


def _named_locally(source: str | None) -> bool:
    return bool(source) and (is_path_like(source) or Path(source).expanduser().exists())


def pull_roots(config: LauncherConfig) -> LocalRoots:
    """The roots local pulls are allowed under (the router is given the same)."""
    launched = [source for source in (config.model_id, config.weights_cache_override)
                if _named_locally(source)]
    return LocalRoots.of([*split_paths(config.router.get("allowed_local_model_path")),
                          cache_root(), config.registry_dir(), *launched])
