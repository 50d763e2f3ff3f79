"""What a request asks, checked before it is queued.

Field ranges and readers, TGI's validation, structured-output grammars, seeds, generation_config,
JSON text, the tokenizer and the chat template.
"""
