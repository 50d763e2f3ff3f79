"""The values of --quantize and --kv-cache-dtype: tgi-py's, and TGI's it refuses with the reason."""
from __future__ import annotations

from shard.config import DTYPES, QUANTIZE_KINDS
from shard.quant_config import CHECKPOINT_QUANTIZE


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


# TGI's --quantize kinds that name the checkpoint's own quantization (shard/quant_config.py):
# accepted where config.json's quantization_config is of that kind
# (fp8 is both: it quantizes an unquantized checkpoint, and names an FP8 checkpoint's own)
QUANTIZE_VALUES = tuple(dict.fromkeys((*QUANTIZE_KINDS, *CHECKPOINT_QUANTIZE)))
# TGI's --quantize kinds tgi-py does not implement: why each is refused
TGI_QUANTIZE = {
    "exl2": "it needs exllamav2's checkpoint format, which tgi-py does not read",
    **dict.fromkeys(("eetq", "bitsandbytes", "bitsandbytes-nf4", "bitsandbytes-fp4"),
                    "its kernels are not part of tgi-py"),
}


def shard_quantize(quantize: str | None) -> str | None:
    """What the shards quantize as they load: tgi-py's own kinds only.

    TGI's checkpoint kinds only check the checkpoint (launcher.resolve.check_quantization): the
    shards read its quantization_config themselves."""
    return quantize if quantize in QUANTIZE_KINDS else None
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
