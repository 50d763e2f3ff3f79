"""SGLang's error body, `{"error": {"message", "type", "code"}}`."""
from __future__ import annotations

from router.errors import RouterError


def sglang_error_body(error: RouterError) -> dict:
    """SGLang's error object: the message, TGI's error_type and the HTTP status."""
    return {"error": {"message": str(error), "type": error.error_type, "code": error.status}}
