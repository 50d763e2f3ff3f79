"""Jan's and Cortex's /v1/models lifecycle routes: list, pull, start, stop, patch, delete."""
