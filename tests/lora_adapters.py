"""LoRA adapters made on the fly with peft over a model directory, saved as PEFT saves them."""
from __future__ import annotations

from pathlib import Path

import torch

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL_LINEAR = ATTENTION + ["gate_proj", "up_proj", "down_proj"]


def build_adapter(model_dir: Path, out_dir: Path, *, rank: int = 8, alpha: float = 16,
                  targets: list[str] | None = None, seed: int = 1, rslora: bool = False,
                  std: float = 0.05) -> Path:
    """A LoRA adapter for the model in `model_dir` with random non-zero A and B (a freshly
    initialised adapter's B is zero, which would change nothing), saved to `out_dir`."""
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets or ALL_LINEAR,
                             lora_dropout=0.0, use_rslora=rslora, init_lora_weights=False,
                             task_type="CAUSAL_LM")
    model = peft.get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    model.save_pretrained(out_dir)
    return Path(out_dir)


def reference_model(model_dir: Path, adapter_dir: Path | None):
    """transformers' model (float32) with the adapter applied by peft, or the base alone."""
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if adapter_dir is None:
        return base
    return peft.PeftModel.from_pretrained(base, str(adapter_dir)).eval()


def greedy_reference(model, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy tokens by full forwards (no cache): the plainest reference."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(torch.tensor([tokens])).logits[0, -1]
            tokens.append(int(logits.argmax()))
    return tokens[len(prompt):]


def generate_reference(model, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy generate (with its KV cache; stops at the end-of-sequence token)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()
