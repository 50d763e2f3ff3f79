"""The router's tokenizer: encodes prompts for validation and for the shards, in worker threads."""
from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tokenizers import Tokenizer


class RouterTokenizer:
    def __init__(self, model_dir: str, *, workers: int = 2):
        directory = Path(model_dir)
        self.tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        config_path = directory / "tokenizer_config.json"
        self.config = json.loads(config_path.read_text()) if config_path.exists() else {}
        self._pool = ThreadPoolExecutor(max_workers=max(workers, 1),
                                        thread_name_prefix="tokenizer")

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    async def encode_async(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        encoding = await self._encoding(text, add_special_tokens)
        return encoding.ids

    async def encode_offsets_async(self, text: str, *, add_special_tokens: bool = True
                                   ) -> tuple[list[int], list[tuple[int, int]]]:
        """(ids, the character span of each)."""
        encoding = await self._encoding(text, add_special_tokens)
        return encoding.ids, encoding.offsets

    async def _encoding(self, text: str, add_special_tokens: bool):
        """The text's encoding, off the event loop for a long text."""
        def encode():
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

        if len(text) < 2048:  # short prompts cost less than a thread hop
            return encode()
        return await asyncio.get_running_loop().run_in_executor(self._pool, encode)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)
