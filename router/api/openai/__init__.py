"""OpenAI's /v1 API: chat and legacy completions, with their request parsing and chunk shapes."""
