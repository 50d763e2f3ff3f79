"""SGLang's native /generate and its companion routes (/abort_request, /flush_cache, ...)."""
