"""The router's tokenizer: encodes prompts for validation and for the shards, in worker threads."""
from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tokenizers import Tokenizer

from router.errors import ValidationError

# pre-tokenizers that split the text without dropping or rewriting any of it
_KEEPING_SPLITS = {"ByteLevel", "Digits"}
_KEEPING_SPLIT_BEHAVIOURS = {"Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous"}


class RouterTokenizer:
    def __init__(self, model_dir: str, *, workers: int = 2):
        directory = Path(model_dir)
        self.tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        # a checkpoint's own padding and truncation (sentence-transformers' tokenizers pad to a
        # fixed length) would change every prompt: lengths are the router's to check
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()
        config_path = directory / "tokenizer_config.json"
        self.config = json.loads(config_path.read_text()) if config_path.exists() else {}
        self._pool = ThreadPoolExecutor(max_workers=max(workers, 1),
                                        thread_name_prefix="tokenizer")
        self.max_token_bytes = max_token_bytes(json.loads(self.tokenizer.to_str()))

    def fewest_tokens(self, text: str) -> int:
        """A floor on the text's token count, found without encoding it (0 when none is known)."""
        if self.max_token_bytes is None:
            return 0
        # a character is at least one UTF-8 byte, so len(text) needs no encoding
        return -(-len(text) // self.max_token_bytes)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    async def encode_async(self, text: str, *, add_special_tokens: bool = True,
                           max_tokens: int | None = None) -> list[int]:
        """The text's ids; one longer than max_tokens is refused without encoding it.

        Refused only with max_tokens given, for a text that must have more ids: a prompt of
        megabytes costs seconds of tokeniser time."""
        if max_tokens is not None and (fewest := self.fewest_tokens(text)) > max_tokens:
            raise ValidationError(f"`inputs` must have less than {max_tokens} tokens. "
                                  f"Given: at least {fewest}")
        return await self._encoded(text, add_special_tokens, lambda encoding: encoding.ids)

    async def encode_offsets_async(self, text: str, *, add_special_tokens: bool = True
                                   ) -> tuple[list[int], list[tuple[int, int]]]:
        """(ids, the character span of each)."""
        return await self._encoded(text, add_special_tokens,
                                   lambda encoding: (encoding.ids, encoding.offsets))

    async def _encoded(self, text: str, add_special_tokens: bool, read):
        """read(the text's encoding), off the event loop for a long text.

        The lists it reads out are built there too."""
        if len(text) < 2048:  # short prompts cost less than a thread hop
            return read(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

        def encode():
            # encode_batch lets go of the GIL while it works; encode holds it, so a long text
            # would stall the event loop for as long as it takes, even from a thread
            return read(self.tokenizer.encode_batch([text],
                                                    add_special_tokens=add_special_tokens)[0])

        return await asyncio.get_running_loop().run_in_executor(self._pool, encode)

    async def encode_many_async(self, texts: list[str]) -> list[list[int]]:
        """The ids of each text, special tokens added, encoded together off the event loop."""
        def encode():
            return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=True)]

        if sum(len(t) for t in texts) < 2048:
            return encode()
        return await asyncio.get_running_loop().run_in_executor(self._pool, encode)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def max_token_bytes(spec: dict) -> int | None:
    """The most input bytes one token can stand for, where the tokenizer bounds it.

    The tokenizer's JSON `spec` guarantees a bound for byte-level BPE with no normaliser and
    pre-tokenizers that drop nothing, where each vocabulary character is one input byte. None for
    any other tokenizer."""
    model = spec.get("model") or {}
    if spec.get("normalizer") is not None or model.get("type") != "BPE" or model.get("fuse_unk"):
        return None  # (fused, one unknown token stands for any number of bytes)
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if not any(step.get("type") == "ByteLevel" for step in steps):
        return None
    for step in steps:
        if step.get("type") == "Split" and step.get("behavior") in _KEEPING_SPLIT_BEHAVIOURS:
            continue
        if step.get("type") not in _KEEPING_SPLITS:
            return None
    added = spec.get("added_tokens") or []
    if any(token.get("lstrip") or token.get("rstrip") for token in added):
        return None  # such a token also takes the spaces beside it: no bound
    lengths = [len(token) for token in model.get("vocab") or {}]
    lengths += [len(token.get("content", "").encode()) for token in added]
    return max(lengths, default=0) or None
