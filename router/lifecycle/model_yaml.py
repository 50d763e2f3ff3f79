"""A Cortex model.yml's own fields on PATCH /v1/models/{id}, put where this server keeps them.

Cortex writes a model's settings flat (`ctx_len`, `ngl`, `prompt_template`, `max_tokens`, `stop`,
penalties: its model.yml); Jan's document groups them (`settings`, `parameters`,
`engine_parameters`). model_yaml_body moves each flat field into its group, where
router/lifecycle/settings.py checks it and the model applies it:

- `ctx_len`, `ngl`, `n_parallel`, `cpu_threads`, `embedding` (and this server's `num_shard`,
  `dtype`, `max_batch_total_tokens`) -> settings (applied at the next start);
- `temperature`, `top_p`, `top_k`, `stream`, `stop`, `frequency_penalty`, `presence_penalty`, and
  `max_tokens` (as `token_limit`) -> parameters: the defaults of the model's OpenAI requests;
- `prompt_template` -> engine_parameters: Cortex's `{system_message}` / `{prompt}` template,
  the chat prompt of a model without a chat template.

`engine` names the engine serving the model: this server's, or llama.cpp's names (Cortex's
`llama-cpp`, `cortex.llamacpp`, Jan's `nitro`), which it stands in for since it serves their GGUF
files converted; any other engine is a 422, as the model cannot move to it. The fields that
describe the model rather than set it (`id`, `model`, `object`, `created`, `owned_by`, `files`,
...) are accepted unchanged, as a client sending back the whole file does, and refused changed.
"""
from __future__ import annotations

from router.errors import ValidationError
from router.lifecycle.settings import SETTINGS

_GROUPS = {
    # Cortex's ctx_len, ngl, n_parallel, cpu_threads, embedding, and this server's own settings,
    # which a Cortex start's body has always taken flat
    "settings": tuple(SETTINGS),
    "parameters": ("temperature", "top_p", "top_k", "stream", "stop", "frequency_penalty",
                   "presence_penalty"),
    "engine_parameters": ("prompt_template",),
}
_RENAMED = {"max_tokens": ("parameters", "token_limit")}
ENGINES = ("tgi-py", "hf_inference", "llama-cpp", "llamacpp", "cortex.llamacpp", "nitro")
# what describes the model: its value now, by the name of the field in the model's JSON
_DESCRIPTIVE = {"id": "id", "model": "id", "object": "object", "created": "created",
                "owned_by": "owned_by", "type": "type", "format": "format",
                "source_url": "source_url", "state": "state", "assets": "assets",
                "files": "assets"}  # Cortex's files: the model's assets here


def model_yaml_body(body: dict, current: dict) -> dict:
    """A PATCH body with Cortex's flat fields moved into their groups.

    `current`: the model's JSON (router/api/models/routes.py), which a descriptive field must
    match."""
    out = {key: value for key, value in body.items()
           if key not in _DESCRIPTIVE and key not in ("engine", "version", "model_type")
           and key not in _RENAMED and not any(key in keys for keys in _GROUPS.values())}
    for key, value in body.items():
        target = _RENAMED.get(key) or next(((group, key) for group, keys in _GROUPS.items()
                                            if key in keys), None)
        if target is not None:
            group, name = target
            given = out.get(group) or {}
            if not isinstance(given, dict):
                raise ValidationError(f"`{group}` must be an object")
            out[group] = {**given, name: value}
        elif key in _DESCRIPTIVE:
            _unchanged(key, value, current.get(_DESCRIPTIVE[key]))
    _check_engine(body.get("engine"))
    if body.get("version") not in (None, 1, "1"):
        raise ValidationError("`version` must be 1: the model.yml format this server reads")
    if body.get("model_type") not in (None, "llm", "embedding"):
        raise ValidationError("`model_type` must be llm or embedding")
    if body.get("model_type") == "embedding":  # Cortex's way to say Jan's `embedding: true`
        out["settings"] = {**(out.get("settings") or {}), "embedding": True}
    return out


def _unchanged(key: str, value, now) -> None:
    if value != now:
        raise ValidationError(f"`{key}` cannot be changed (it is {now!r}): it describes the "
                              "model; pull under another id for another model")


def _check_engine(engine) -> None:
    if engine is None:
        return
    if not isinstance(engine, str) or engine.lower() not in ENGINES:
        raise ValidationError(f"`engine` {str(engine)[:100]!r} is refused: this server runs "
                              "its own engine, which also serves llama.cpp's GGUF files "
                              f"(converted); it takes {', '.join(ENGINES)}, which all name it")
