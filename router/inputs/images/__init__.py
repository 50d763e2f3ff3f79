"""A prompt's images: where they come from, the check that they are images, their prompt tokens.

sources.py reads an image's bytes (a data: URL, an http(s) URL, a local file), check.py decodes
each once with Pillow, family.py and its family modules (gemma3.py, qwen2_vl.py) say which models
take images and what an image becomes in the prompt, and placement.py puts each over its
placeholder tokens.
"""
