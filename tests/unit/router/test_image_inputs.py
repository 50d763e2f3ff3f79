"""A prompt's images: their sources, the Pillow check, Gemma 3's expansion and their token spans."""
import base64
import json

import pytest

from router.errors import ValidationError
from router.inputs.images.check import ImageSize, check_image
from router.inputs.images.family import image_family, names_image_family
from router.inputs.images.placement import expanded, markdown_images, placed
from router.inputs.images.sources import (ImageSource, LoadedImage, MediaLimits, load_images,
                                         read_source)
from router.inputs.tokenizer import RouterTokenizer
from router.lifecycle.local_paths import LocalRoots
from tests.image_files import bomb_png, data_url, image_bytes, truncated_png
from tests.tiny_models import GEMMA3_TOKENS_PER_IMAGE, build_tiny_gemma3_vlm


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    return build_tiny_gemma3_vlm(tmp_path_factory.mktemp("gemma3-vlm"))


@pytest.fixture(scope="module")
def family(gemma3_dir):
    return image_family(str(gemma3_dir), RouterTokenizer(str(gemma3_dir)).tokenizer.id_to_token)


def _loaded(count: int) -> list[LoadedImage]:
    return [LoadedImage(b"%d" % i, b"d%d" % i, ImageSize("PNG", 8 + i, 8)) for i in range(count)]


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_an_image_of_each_format_is_read_with_its_size(fmt):
    size = check_image(image_bytes(17, 9, fmt=fmt), "the image")
    assert (size.format, size.width, size.height) == (fmt, 17, 9)


@pytest.mark.parametrize("data, words", [
    (b"", "is empty (0 bytes)"),
    (b"%PDF-1.4 not a picture", "is not an image"),
    (truncated_png(), "truncated or corrupt"),
    (bomb_png(), "decompression bomb (Image size (10000000000 pixels) exceeds limit"),
    (bomb_png(9500, 9500), "decompression bomb (Image size (90250000 pixels) exceeds"),
])
def test_what_is_not_an_image_is_a_422_naming_the_problem(data, words):
    with pytest.raises(ValidationError) as caught:
        check_image(data, "messages[0].content[1].image_url")
    assert words in caught.value.message
    assert caught.value.message.startswith("messages[0].content[1].image_url")


async def test_data_urls_base64_and_percent_escaped():
    png = image_bytes()
    limits = MediaLimits()
    assert await read_source(ImageSource(data_url(png), "x"), limits) == png
    escaped = "data:image/png," + "".join(f"%{b:02x}" for b in png)
    assert await read_source(ImageSource(escaped, "x"), limits) == png
    # plain base64 is SGLang's only
    bare = base64.b64encode(png).decode()
    assert await read_source(ImageSource(bare, "x"), limits, bare_base64=True) == png
    with pytest.raises(ValidationError, match="must be a data: URL"):
        await read_source(ImageSource(bare, "x"), limits)


@pytest.mark.parametrize("url, words", [
    ("data:image/png;base64,@@@", "is not valid base64"),
    ("data:text/plain;base64,aGk=", "of type 'text/plain', not an image"),
    ("data:image/png;base64", "without its ','"),
    ("ftp://example.com/a.png", "must be a data: URL"),
])
async def test_bad_data_urls_are_refused(url, words):
    with pytest.raises(ValidationError, match=words):
        await read_source(ImageSource(url, "x"), MediaLimits())


async def test_size_bound_and_remote_switch():
    small = MediaLimits(max_image_bytes=100)
    with pytest.raises(ValidationError, match="larger than 100 bytes"):
        await read_source(ImageSource(data_url(image_bytes(64, 64, fmt="BMP")), "x"), small)
    off = MediaLimits(fetch_remote=False)
    with pytest.raises(ValidationError, match="fetches no image URLs"):
        await read_source(ImageSource("http://127.0.0.1:9/a.png", "x"), off)


async def test_local_files_only_under_the_allowed_directory(tmp_path):
    allowed, outside = tmp_path / "media", tmp_path / "other"
    allowed.mkdir(), outside.mkdir()
    png = image_bytes()
    (allowed / "a.png").write_bytes(png)
    (outside / "b.png").write_bytes(png)
    (allowed / "link.png").symlink_to(outside / "b.png")
    with pytest.raises(ValidationError, match="reads no local files"):
        await read_source(ImageSource(str(allowed / "a.png"), "x"), MediaLimits())
    limits = MediaLimits(local_roots=LocalRoots.of([allowed]))
    assert await read_source(ImageSource(str(allowed / "a.png"), "x"), limits) == png
    assert await read_source(ImageSource((allowed / "a.png").as_uri(), "x"), limits) == png
    for refused in (outside / "b.png", allowed / "link.png", allowed / ".." / "other" / "b.png",
                    outside / "missing.png"):
        with pytest.raises(ValidationError, match="not under --allowed-local-media-path"):
            await read_source(ImageSource(str(refused), "x"), limits)
    with pytest.raises(ValidationError, match="could not be read"):
        await read_source(ImageSource(str(allowed / "missing.png"), "x"), limits)


async def test_images_past_the_count_are_refused_before_any_is_read():
    sources = [ImageSource("http://127.0.0.1:9/never-fetched.png", f"image {i}") for i in range(3)]
    with pytest.raises(ValidationError, match=r"holds 3 images, more than the 2 .*"
                                              r"--max-images-per-request"):
        await load_images(sources, MediaLimits(max_images=2))
    loaded = await load_images([ImageSource(data_url(image_bytes(3, 5)), "x")], MediaLimits())
    assert (loaded[0].size.width, loaded[0].size.height) == (3, 5)
    assert len(loaded[0].digest) == 32


def test_gemma3_config_gives_its_image_family(gemma3_dir, family, tmp_path):
    assert family.marker == "<start_of_image>"
    for size in (ImageSize("PNG", 3, 5), ImageSize("JPEG", 4000, 20)):  # any size alike
        assert family.token_count(size) == GEMMA3_TOKENS_PER_IMAGE
        assert family.expansion(size) == ("\n\n<start_of_image>" + "<image_soft_token>" * 4
                                          + "<end_of_image>\n\n")
    assert names_image_family(str(gemma3_dir))
    config = json.loads((gemma3_dir / "config.json").read_text())
    lacking = tmp_path / "lacking"
    lacking.mkdir()
    (lacking / "config.json").write_text(json.dumps({**config, "mm_tokens_per_image": None}))
    assert image_family(str(lacking), lambda i: "x") is None  # served as text only
    (lacking / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert image_family(str(lacking), lambda i: "x") is None
    assert not names_image_family(str(lacking)) and not names_image_family(None)


def test_the_prompt_tokens_are_transformers_gemma3_processors(gemma3_dir, family):
    transformers = pytest.importorskip("transformers")
    from PIL import Image

    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(gemma3_dir / "tokenizer.json"),
        extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                              "image_token": "<image_soft_token>"})
    processor = transformers.Gemma3Processor(
        image_processor=transformers.Gemma3ImageProcessorPil(size={"height": 32, "width": 32}),
        tokenizer=tokenizer, image_seq_length=GEMMA3_TOKENS_PER_IMAGE)
    text = "user: look <start_of_image> and<start_of_image>!\n"
    theirs = processor(text=[text], images=[[Image.new("RGB", (5, 5)), Image.new("RGB", (9, 4))]],
                       add_special_tokens=False)["input_ids"][0]
    ours = RouterTokenizer(str(gemma3_dir)).encode(expanded(text, family, _loaded(2)),
                                                   add_special_tokens=False)
    assert ours == list(theirs)
    assert family.image_token_id == tokenizer.image_token_id


def test_each_image_goes_over_its_run_of_image_tokens(gemma3_dir, family):
    tokenizer = RouterTokenizer(str(gemma3_dir))
    text, sources = markdown_images("a ![](http://x/1.png) b ![](data:image/png;base64,AA) c",
                                    family, "`inputs`")
    assert [s.where for s in sources] == ["http://x/1.png", "data:image/png;base64,AA"]
    assert text == "a <start_of_image> b <start_of_image> c"
    loaded = _loaded(2)
    ids = tokenizer.encode(expanded(text, family, loaded))
    images = placed(ids, family, loaded)
    assert [(i.digest, i.token_count) for i in images] == [(b"d0", 4), (b"d1", 4)]
    for image in images:
        span = ids[image.token_offset:image.token_offset + image.token_count]
        assert span == [family.image_token_id] * 4
        assert ids[image.token_offset - 1] == tokenizer.tokenizer.token_to_id("<start_of_image>")
    with pytest.raises(ValidationError, match="holds 1 image markers .* for 2 images"):
        expanded("one <start_of_image> only", family, loaded)
    with pytest.raises(ValidationError, match="image tokens do not match"):
        placed(ids[:images[1].token_offset + 2], family, loaded)  # cut inside the second
    with pytest.raises(ValidationError, match="image tokens do not match"):
        placed(tokenizer.encode(expanded("<start_of_image><image_soft_token>", family,
                                         loaded[:1])),
               family, loaded[:1])


def test_qwen_vl_tokens_follow_each_images_size_as_transformers_counts_them(tmp_path):
    """Qwen2.5-VL's family: smart_resize's grid, from config.json and preprocessor_config.json,
    equal to transformers' processor's count for sizes it keeps, shrinks and grows."""
    import json

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil)

    from router.inputs.images.check import ImageSize

    settings = {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 320, "patch_size": 14,
                "merge_size": 2}
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2_5_VLForConditionalGeneration"], "image_token_id": 7,
        "vision_start_token_id": 5, "vision_end_token_id": 6}))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(settings))
    texts = {5: "<s>", 6: "</s>", 7: "<p>"}
    family = image_family(str(tmp_path), texts.get)
    assert family.marker == "<s><p></s>" and family.image_token_id == 7
    reference = Qwen2VLImageProcessorPil(**settings)
    for width, height in [(448, 448), (1000, 800), (20, 30), (90, 700), (1000, 64)]:
        size = ImageSize("PNG", width, height)
        count = reference.get_number_of_image_patches(height, width) // 4
        assert family.token_count(size) == count, (width, height)
        assert family.expansion(size) == "<s>" + "<p>" * count + "</s>"
