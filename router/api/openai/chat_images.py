"""The images of a chat's messages: `image_url` content parts, as OpenAI and TGI write them.

For a model that takes images, a message holding one keeps its parts, each image part becoming
{"type": "image"} as chat templates read it (Gemma 3's writes its image marker there); its text
parts stay in order. For a model that reads text only, an image part is a 422 saying so.
"""
from __future__ import annotations

from router.errors import ValidationError
from router.inputs.images.family import ImageFamily
from router.inputs.images.placement import text_only_refusal
from router.inputs.images.sources import ImageSource

PART_TYPES = ("text", "image_url")


def _check_part(part, index: int) -> None:
    if not isinstance(part, dict) or part.get("type") not in PART_TYPES:
        raise ValidationError(f"messages[{index}].content: each part must be "
                              "{\"type\": \"text\", \"text\": ...} or {\"type\": \"image_url\", "
                              "\"image_url\": {\"url\": ...}}")


def content_parts(content: list, index: int, images: ImageFamily | None,
                  model: str) -> str | list[dict]:
    """A message's list of parts as the template gets it: its text, or its text and images."""
    for part in content:
        _check_part(part, index)
    if not any(part["type"] == "image_url" for part in content):
        return "".join(str(part.get("text", "")) for part in content)
    if images is None:
        raise text_only_refusal(model)
    return [{"type": "text", "text": str(part.get("text", ""))} if part["type"] == "text"
            else {"type": "image"} for part in content]


def image_sources(messages: list) -> list[ImageSource]:
    """The images of `messages` (already checked by content_parts), in prompt order."""
    sources = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if part["type"] != "image_url":
                continue
            what = f"messages[{i}].content[{j}].image_url"
            value = part.get("image_url")
            url = value.get("url") if isinstance(value, dict) else value
            if not isinstance(url, str):
                raise ValidationError(f"{what} must be {{\"url\": \"data:image/png;base64,...\"}} "
                                      "or the URL as a string")
            sources.append(ImageSource(url, what))
    return sources


def part_text(content, marker: str = "") -> str:
    """A message's content as text: its parts' text, each image `marker`."""
    if isinstance(content, str) or content is None:
        return content or ""
    return "".join(part.get("text", "") if part.get("type") == "text" else marker
                   for part in content)


def with_markers(messages: list[dict], marker: str) -> list[dict]:
    """The messages with text content only, each image its marker: for a prompt without a template."""
    return [{**m, "content": part_text(m["content"], marker)} if isinstance(m.get("content"), list)
            else m for m in messages]
