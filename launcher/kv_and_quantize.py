"""The values of --quantize and --kv-cache-dtype: tgi-py's, and TGI's it refuses with the reason."""
from __future__ import annotations

from shard.config import DTYPES


class Choices(tuple):
    """A flag's values, which --help and argparse's refusal offer.

    `in` also lets through `refused`, TGI's values that LauncherConfig refuses with its reason
    (argparse's "invalid choice" would not say why).
    """

    def __new__(cls, offered, refused):
        self = super().__new__(cls, offered)
        self.refused = frozenset(refused)
        return self

    def __contains__(self, value) -> bool:
        return tuple.__contains__(self, value) or value in self.refused


# TGI's --quantize kinds, none of which tgi-py implements: why each is refused
TGI_QUANTIZE = {
    **dict.fromkeys(("awq", "gptq", "marlin", "exl2", "compressed-tensors"),
                    "it needs a checkpoint quantized by that method, and tgi-py loads "
                    "unquantized (or GGUF) checkpoints only"),
    **dict.fromkeys(("eetq", "bitsandbytes", "bitsandbytes-nf4", "bitsandbytes-fp4", "fp8"),
                    "its kernels are not part of tgi-py"),
}
FP8_KV = ("fp8_e4m3fn", "fp8_e5m2")  # TGI's --kv-cache-dtype values
KV_INT8 = "int8"  # tgi-py's 8-bit KV cache (shard/layers/kv_int8.py)


def kv_cache_dtype(kv: str | None, dtype: str | None) -> tuple[str | None, str | None]:
    """--kv-cache-dtype and --dtype as the shards take them; a ValueError for what they refuse.

    The cache is int8 (the shards' 8-bit cache), or the model's dtype, which is the cache's
    anyway: a dtype given as --kv-cache-dtype sets --dtype when that is not given, and must equal
    it when it is.
    """
    kv = kv or None
    if kv is None or kv == KV_INT8:
        return kv, dtype
    if kv in FP8_KV:
        raise ValueError(f"--kv-cache-dtype {kv}: no FP8 KV cache is implemented; int8 is "
                         "tgi-py's 8-bit KV cache (int8 with a scale per token and head, "
                         "on the CPU): give --kv-cache-dtype int8, or leave it out for the "
                         f"model's dtype ({', '.join(DTYPES)})")
    if kv not in DTYPES:
        raise ValueError(f"--kv-cache-dtype {kv!r} is not one of {', '.join(DTYPES)} or "
                         f"{KV_INT8} (TGI's {', '.join(FP8_KV)} are not implemented)")
    if dtype is None:
        return kv, kv
    if dtype != kv:
        raise ValueError(f"--kv-cache-dtype {kv} with --dtype {dtype}: the KV cache is "
                         "kept in the model's dtype; give one of them, or the same twice")
    return kv, dtype
