"""How a checkpoint pools its hidden states into one embedding (its sentence-transformers files).

`modules.json` lists the modules sentence-transformers runs after the transformer: a Pooling module
(whose directory's config.json names the mode) and, optionally, a Normalize module. A checkpoint
without them is pooled by mean, unnormalized, as sentence-transformers wraps a bare model.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

MODES = ("mean", "cls", "last", "max", "mean_sqrt_len")
# sentence-transformers' names (its `pooling_mode`, and the legacy pooling_mode_* keys) -> ours
_ST_MODES = {"mean": "mean", "cls": "cls", "lasttoken": "last", "max": "max",
             "mean_sqrt_len_tokens": "mean_sqrt_len"}
# the legacy keys' suffixes -> sentence-transformers' names
_LEGACY_NAMES = {"cls_token": "cls", "mean_tokens": "mean", "max_tokens": "max",
                 "mean_sqrt_len_tokens": "mean_sqrt_len_tokens", "lasttoken": "lasttoken"}


@dataclass(frozen=True, slots=True)
class PoolingConfig:
    mode: str = "mean"  # one of MODES; "" where the checkpoint's pooling is not one served here
    normalize: bool = False  # a Normalize module follows the pooling
    declared: bool = False  # the checkpoint has sentence-transformers' modules.json
    max_seq_length: int | None = None  # sentence_bert_config.json's: longer inputs are refused
    matryoshka: bool = False  # config.json declares Matryoshka embeddings
    matryoshka_dimensions: tuple[int, ...] = ()
    why_not: str = ""  # with mode "": what the checkpoint asks that is not served


def read_pooling(model_dir: Path, config: dict) -> PoolingConfig:
    """The pooling a model directory declares; mean and unnormalized where it declares none."""
    matryoshka = dict(matryoshka=bool(config.get("is_matryoshka") or
                                      config.get("matryoshka_dimensions")),
                      matryoshka_dimensions=tuple(int(d) for d in
                                                  config.get("matryoshka_dimensions") or ()))
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return PoolingConfig(**matryoshka)
    modules = json.loads(modules_file.read_text())
    kinds = {m.get("type", "").rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    mode, why_not = "mean", ""
    if "Pooling" in kinds:
        pooling_file = model_dir / kinds["Pooling"].get("path", "") / "config.json"
        settings = json.loads(pooling_file.read_text()) if pooling_file.is_file() else {}
        mode, why_not = _mode(settings)
    max_seq_length = None
    bert_config = model_dir / "sentence_bert_config.json"
    if bert_config.is_file():
        max_seq_length = json.loads(bert_config.read_text()).get("max_seq_length")
    return PoolingConfig(mode=mode, normalize="Normalize" in kinds, declared=True,
                         max_seq_length=max_seq_length, why_not=why_not, **matryoshka)


def _mode(settings: dict) -> tuple[str, str]:
    """(our mode, "") for a Pooling module's config.json, or ("", why) for one not served."""
    names = settings.get("pooling_mode")
    if names is None:
        names = [_LEGACY_NAMES[key.removeprefix("pooling_mode_")] for key, on in settings.items()
                 if key.removeprefix("pooling_mode_") in _LEGACY_NAMES and on is True]
    names = [names] if isinstance(names, str) else list(names or ["mean"])
    if len(names) != 1 or names[0] not in _ST_MODES:
        return "", f"sentence-transformers pooling {names} is not served (one of " \
                   f"{', '.join(_ST_MODES)} is)"
    if settings.get("include_prompt") is False:
        return "", "pooling that leaves out an instruction prompt is not served"
    return _ST_MODES[names[0]], ""


def pool(hidden: torch.Tensor, mode: str) -> torch.Tensor:
    """One sequence's final hidden states [n, hidden] -> its embedding [hidden], in float32."""
    hidden = hidden.float()
    if mode == "mean":
        return hidden.mean(0)
    if mode == "cls":
        return hidden[0]
    if mode == "last":
        return hidden[-1]
    if mode == "max":
        return hidden.max(0).values
    if mode == "mean_sqrt_len":
        return hidden.sum(0) / math.sqrt(hidden.shape[0])
    raise ValueError(f"pooling {mode!r} is not one of {', '.join(MODES)}")
