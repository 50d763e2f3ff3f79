"""SGLang's `image_data` (and `modalities`): each prompt's images, read and checked.

As SGLang takes it: one image (a URL, a file path or base64, plain or as {"url": ...}) or a list of
images for a single prompt; for a batch, one entry per prompt, each an image, a list or null. A
prompt's text holds one image marker per image, or none (its images then go first, as
transformers places them); images go with `text`, never with token ids or embeddings.
"""
from __future__ import annotations

from router.errors import ValidationError
from router.inputs.images.family import ImageFamily
from router.inputs.images.placement import expanded, text_only_refusal
from router.inputs.images.sources import ImageSource, LoadedImage, MediaLimits, load_images

MODALITIES = ("image", "multi-images")  # SGLang's names of what this server takes


def _item(value, what: str) -> ImageSource:
    if isinstance(value, dict):
        value = value.get("url")
    if not isinstance(value, str) or not value:
        raise ValidationError(f"`{what}` must be an image: a URL, a file path or base64 (or "
                              "{\"url\": ...})")
    return ImageSource(value, f"`{what}`")


def _prompt_sources(value, what: str) -> list[ImageSource]:
    if value is None:
        return []
    if isinstance(value, list):
        return [_item(v, f"{what}[{i}]") for i, v in enumerate(value)]
    return [_item(value, what)]


def image_sources(body: dict, count: int, is_batch: bool) -> list[list[ImageSource]]:
    """Each prompt's images (empty lists without `image_data`)."""
    value = body.get("image_data")
    if value is None:
        return [[] for _ in range(count)]
    if not is_batch:
        return [_prompt_sources(value, "image_data")]
    if not isinstance(value, list) or len(value) != count:
        raise ValidationError(f"`image_data` of a batch of {count} prompts must be a list of "
                              f"{count} entries: an image, a list of images or null each")
    return [_prompt_sources(v, f"image_data[{i}]") for i, v in enumerate(value)]


def check_modalities(body: dict) -> None:
    modalities = body.get("modalities")
    if modalities is None:
        return
    if not isinstance(modalities, list) or not all(m in MODALITIES for m in modalities):
        raise ValidationError(f"`modalities` must be a list of {' or '.join(MODALITIES)}: this "
                              "server takes images, not video or audio")


async def prompt_images(body: dict, count: int, is_batch: bool, field_name: str,
                        family: ImageFamily | None, media: MediaLimits, model: str
                        ) -> list[list[LoadedImage]]:
    """Each prompt's images, read and checked (each prompt within --max-images-per-request)."""
    sources = image_sources(body, count, is_batch)
    if not any(sources):
        return [[] for _ in range(count)]
    if family is None:
        raise text_only_refusal(model)
    if field_name != "text":
        raise ValidationError("`image_data` goes with `text`, whose image markers it fills; "
                              f"not with `{field_name}`")
    return [await load_images(s, media, bare_base64=True) if s else [] for s in sources]


def text_with_images(text: str, family: ImageFamily, images: list[LoadedImage]) -> str:
    """The prompt to tokenize: its markers (or, without any, one per image first) expanded."""
    if images and family.marker not in text:
        text = family.marker * len(images) + text
    return expanded(text, family, images)
