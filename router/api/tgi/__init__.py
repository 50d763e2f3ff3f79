"""TGI's HTTP API: /, /generate, /generate_stream, /tokenize, /health, /info, /metrics."""
