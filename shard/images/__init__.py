"""A vision-language model's images: decoding, preprocessing and checking them beside a prompt."""
