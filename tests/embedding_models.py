"""Embedding checkpoints for tests: tiny random Qwen3-Embedding-style and BERT models, ten texts.

Qwen3-Embedding is a Qwen3 decoder saved with sentence-transformers' files: last-token pooling,
normalized, over a tokenizer that appends the end-of-text token to every input. The BERT is saved
as all-MiniLM is: mean pooling, normalized.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.tiny_models import TINY_VOCAB, build_tokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France.",
    "Embeddings map text to vectors.",
    "A small model wrote short stories.",
    "def add(a, b): return a + b",
    "café naïve façade",
    "Berlin is the capital of Germany, and it is large.",
    "hello",
    "Once upon a time there was a fox.",
    "Vectors near each other mean similar texts, most of the time.",
]


def write_sentence_transformers_files(out_dir: Path, *, pooling: str, normalize: bool,
                                      max_seq_length: int) -> None:
    """modules.json, the Pooling module's config and sentence_bert_config.json, as ST saves them."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (out_dir / "modules.json").write_text(json.dumps(modules))
    (out_dir / "1_Pooling").mkdir(exist_ok=True)
    (out_dir / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": json.loads((out_dir / "config.json").read_text())[
            "hidden_size"], "pooling_mode": pooling, "include_prompt": True}))
    (out_dir / "sentence_bert_config.json").write_text(json.dumps(
        {"max_seq_length": max_seq_length, "do_lower_case": False}))


def build_tiny_qwen3_embedding(out_dir: Path, *, seed: int = 0) -> Path:
    """A random 3-layer Qwen3 (hidden 64) saved as Qwen3-Embedding is: last token, normalized."""
    import transformers
    from tokenizers import Tokenizer, processors

    torch.manual_seed(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = transformers.Qwen3Config(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=2,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight", "norm.weight")):
                param.normal_(1.0, 0.3)  # ones would hide a norm left out
    model.eval().save_pretrained(out_dir)
    build_tokenizer(out_dir)
    tokenizer = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    # Qwen3-Embedding's tokenizer ends every input with its end-of-text token, which it pools
    tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>",
                                                             special_tokens=[("</s>", 2)])
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config_file = out_dir / "tokenizer_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()),
                                       "pad_token": "</s>", "padding_side": "left"}))
    write_sentence_transformers_files(out_dir, pooling="lasttoken", normalize=True,
                                      max_seq_length=256)
    return out_dir


def build_tiny_bert(out_dir: Path, *, seed: int = 0) -> Path:
    """A random 2-layer BERT (hidden 64) saved as all-MiniLM is: mean pooling, normalized.

    Its tokenizer wraps every input in <s> ... </s>, as BERT's in [CLS] ... [SEP]; and the first
    position's embedding carries one large feature, so that the first row of every layer's
    inputs stands out, as trained BERTs' [CLS] rows do (what --quantize int8 must handle). Its
    norms and biases are far from ones and zeros, which would hide one left out, or added on
    every rank."""
    import transformers
    from tokenizers import Tokenizer, processors

    torch.manual_seed(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = transformers.BertConfig(
        vocab_size=TINY_VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=128, pad_token_id=0,
        initializer_range=0.2)
    model = transformers.BertModel(config, add_pooling_layer=False)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "LayerNorm" in name or name.endswith(".bias"):
                param.normal_(1.0 if name.endswith("LayerNorm.weight") else 0.0, 0.3)
        model.embeddings.position_embeddings.weight[0, 5] = 40.0
    model.eval().save_pretrained(out_dir)
    build_tokenizer(out_dir)
    tokenizer = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)])
    tokenizer.save(str(out_dir / "tokenizer.json"))
    # its own tokenizer.json, not BERT's WordPiece that config.json would name (id 0 pads)
    config_file = out_dir / "tokenizer_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()),
                                       "tokenizer_class": "PreTrainedTokenizerFast",
                                       "pad_token": "<unk>"}))
    write_sentence_transformers_files(out_dir, pooling="mean", normalize=True,
                                      max_seq_length=128)
    return out_dir
