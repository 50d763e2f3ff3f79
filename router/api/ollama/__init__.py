"""Ollama's API (/api/generate, /api/chat, /api/tags, ...) over the generation core and lifecycle."""
