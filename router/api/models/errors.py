"""The error bodies of the model routes and of vLLM's LoRA adapter routes."""
from __future__ import annotations

from router.api.tgi.errors import tgi_error_body
from router.errors import ModelStateError, RouterError


def models_error_body(error: RouterError) -> dict:
    """The model routes': TGI's fields, and a 409 names the model's current state."""
    body = tgi_error_body(error)
    if isinstance(error, ModelStateError):
        body["state"] = error.state
    return body


def lora_error_body(error: RouterError) -> dict:
    """vLLM's error object on its LoRA routes (the shape of an OpenAI stream's error frame)."""
    return {"error": {"message": str(error), "type": error.error_type,
                      "http_status_code": error.status}}
