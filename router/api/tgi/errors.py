"""TGI's error body, `{"error", "error_type"}`: every route's unless its API has its own."""
from __future__ import annotations

from router.errors import RouterError


def tgi_error_body(error: RouterError) -> dict:
    """TGI's `{"error", "error_type"}`, for TGI's routes, generate-one's and any by default."""
    return {"error": str(error), "error_type": error.error_type}
