"""Tiny random models and a small tokenizer, made on the fly with `transformers` and `tokenizers`."""
from __future__ import annotations

import json
from pathlib import Path

import torch

TINY_VOCAB = 320
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France, and Berlin is the capital of Germany.",
    "Once upon a time there was a small model that wrote short stories.",
    "café naïve façade — 日本語のテキスト and emoji 🙂 are multi-byte characters.",
    "def add(a, b):\n    return a + b\n",
] * 20


def build_tokenizer(out_dir: Path) -> None:
    """A byte-level BPE tokenizer with <s>/</s> specials, written as tokenizer.json + config."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_CORPUS, trainer)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant:{% endif %}",
    }))


# the tiny Gemma 3 vision model's image scheme: placeholder, start and end ids (inside the tiny
# vocabulary), tokens per image, and the tower's square side in pixels
TINY_IMAGE_TOKENS = dict(image=300, start=301, end=302, per_image=16, side=32)


def build_tiny_gemma3_vision(out_dir: Path, seed: int = 0) -> Path:
    """Saves a random Gemma3ForConditionalGeneration (320-token vocabulary, 32-pixel images)."""
    import transformers

    torch.manual_seed(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokens = TINY_IMAGE_TOKENS
    text = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=512, query_pre_attn_scalar=24, sliding_window=6,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                initializer_range=0.1)
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=4, image_size=tokens["side"],
                  patch_size=4)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision,
                                       mm_tokens_per_image=tokens["per_image"],
                                       image_token_index=tokens["image"],
                                       boi_token_index=tokens["start"],
                                       eoi_token_index=tokens["end"],
                                       bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model = transformers.Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") and "vision_tower" not in name:
                param.normal_(0, 0.5)
        projection = model.model.multi_modal_projector.mm_input_projection_weight
        projection.normal_(0, 0.3)
        model.model.language_model.embed_tokens.weight.mul_(0.3)
    model.eval().save_pretrained(out_dir, safe_serialization=True)
    build_tokenizer(out_dir)
    return out_dir


def build_tiny_model(out_dir: Path, *, architecture: str = "llama", num_heads: int = 4,
                     num_kv_heads: int = 2, seed: int = 0, with_tokenizer: bool = True,
                     tie_word_embeddings: bool = False, attention_bias: bool = False,
                     hidden_size: int = 64, max_position_embeddings: int = 512) -> Path:
    """Saves a random model of the Llama family with a 320-token vocabulary to `out_dir`."""
    import transformers

    torch.manual_seed(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    common = dict(vocab_size=TINY_VOCAB, hidden_size=hidden_size, intermediate_size=128,
                  num_hidden_layers=3, num_attention_heads=num_heads,
                  num_key_value_heads=num_kv_heads,
                  max_position_embeddings=max_position_embeddings,
                  rms_norm_eps=1e-6, tie_word_embeddings=tie_word_embeddings,
                  bos_token_id=1, eos_token_id=2, pad_token_id=2)
    if architecture == "llama":
        config = transformers.LlamaConfig(attention_bias=attention_bias,
                                          rope_parameters={"rope_type": "default",
                                                           "rope_theta": 10000.0}, **common)
        model = transformers.LlamaForCausalLM(config)
    elif architecture == "qwen2":
        config = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        raise ValueError(architecture)
    # random init leaves biases at zero; make them count in the parity tests
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0, 0.5)
    model.eval().save_pretrained(out_dir, safe_serialization=True)
    if with_tokenizer:
        build_tokenizer(out_dir)
    return out_dir


# Gemma 3's image tokens, added to the tiny tokenizer (its chat template writes the first)
GEMMA3_IMAGE_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")
GEMMA3_TOKENS_PER_IMAGE = 4
_GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<start_of_image>{% elif p['type'] == 'text' %}{{ p['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def build_tiny_gemma3_vlm(out_dir: Path, *, with_weights: bool = False) -> Path:
    """A Gemma3ForConditionalGeneration directory: the tiny tokenizer with Gemma 3's image tokens.

    Its config.json says what the router reads (mm_tokens_per_image and the image token ids);
    `with_weights`: a random checkpoint transformers saved, which the shards load.
    """
    from tokenizers import AddedToken, Tokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out_dir)
    tokenizer = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in
                                  ("<start_of_turn>", "<end_of_turn>", *GEMMA3_IMAGE_TOKENS)])
    tokenizer.save(str(out_dir / "tokenizer.json"))
    boi, eoi, image = (tokenizer.token_to_id(t) for t in GEMMA3_IMAGE_TOKENS)
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": _GEMMA3_TEMPLATE}))
    image_config = {"mm_tokens_per_image": GEMMA3_TOKENS_PER_IMAGE, "boi_token_index": boi,
                    "eoi_token_index": eoi, "image_token_index": image}
    if not with_weights:
        (out_dir / "config.json").write_text(json.dumps({
            "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
            **image_config}))
        return out_dir
    import transformers

    torch.manual_seed(0)
    text = transformers.Gemma3TextConfig(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=512, sliding_window=64, bos_token_id=1, eos_token_id=2,
        pad_token_id=2)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             image_size=32, patch_size=8)
    model = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
        text_config=text, vision_config=vision, **image_config))
    model.eval().save_pretrained(out_dir, safe_serialization=True)
    # the image processor's settings for the tower's 32x32 input (Gemma 3's, otherwise)
    transformers.Gemma3ImageProcessorPil(size={"height": 32, "width": 32}).save_pretrained(
        out_dir)
    return out_dir


# Qwen2.5-VL's image tokens, added to the tiny tokenizer; its chat template writes them around
# one <|image_pad|>, which the router expands to the image's grid of tokens
QWEN_VL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
                  "<|im_start|>", "<|im_end|>")
# patches of 4 pixels merged 2x2: a token per 8x8 pixels, 1 to 48 tokens per image
QWEN_VL_PIXELS = dict(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=64,
                      max_pixels=48 * 64)
_QWEN_VL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_tiny_qwen2_5_vl(out_dir: Path, *, seed: int = 0) -> Path:
    """A random Qwen2_5_VLForConditionalGeneration with the tiny tokenizer and Qwen's tokens.

    Windows of 2x2 tokens in the tower's first block, the whole image in its second; M-RoPE
    sections (2, 3, 3) over heads of 16; preprocessor_config.json for 4-pixel patches."""
    import transformers
    from tokenizers import AddedToken, Tokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out_dir)
    tokenizer = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in QWEN_VL_TOKENS])
    tokenizer.save(str(out_dir / "tokenizer.json"))
    start, end, image, video = (tokenizer.token_to_id(t) for t in QWEN_VL_TOKENS[:4])
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": _QWEN_VL_TEMPLATE}))
    torch.manual_seed(seed)
    text = dict(vocab_size=tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                # a small theta: the column section's slow pairs still turn by a few positions
                rope_parameters={"rope_type": "default", "rope_theta": 10.0,
                                 "mrope_section": [2, 3, 3]})
    pixels = QWEN_VL_PIXELS
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  patch_size=pixels["patch_size"], spatial_merge_size=pixels["merge_size"],
                  temporal_patch_size=pixels["temporal_patch_size"], window_size=16,
                  fullatt_block_indexes=[1])
    model = transformers.Qwen2_5_VLForConditionalGeneration(transformers.Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=image, video_token_id=video,
        vision_start_token_id=start, vision_end_token_id=end, bos_token_id=1, eos_token_id=2))
    with torch.no_grad():  # random biases and norms, which initialisation leaves at 0 and 1
        for name, param in model.named_parameters():
            if name.endswith(".bias") or name.endswith("norm.weight") or "ln_q" in name:
                param.normal_(0.0 if name.endswith(".bias") else 1.0, 0.3)
    model.eval().save_pretrained(out_dir, safe_serialization=True)
    (out_dir / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", **pixels}))
    return out_dir
