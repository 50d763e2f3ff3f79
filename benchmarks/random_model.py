"""A random Llama of SmolLM2-135M's shape, saved where the shard can load it.

For timing on a machine that cannot fetch the real weights (the GPU machines lent to a session
reach nothing outside): a step's cost depends on the shapes, not on the values. The tokenizer is
the tests' small one; token ids past its vocabulary decode to nothing.

    python benchmarks/random_model.py --out /tmp/smollm2-shaped [--layers 30]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.tiny_models import build_tokenizer  # noqa: E402

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
                    bos_token_id=1, eos_token_id=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=SMOLLM2_135M["num_hidden_layers"])
    args = parser.parse_args()
    import transformers

    torch.manual_seed(0)
    shape = {**SMOLLM2_135M, "num_hidden_layers": args.layers}
    config = transformers.LlamaConfig(rope_parameters={"rope_type": "default",
                                                       "rope_theta": 100000.0}, **shape)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    build_tokenizer(args.out)
    print(f"random SmolLM2-135M-shaped model ({args.layers} layers) in {args.out}")


if __name__ == "__main__":
    main()
