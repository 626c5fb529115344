"""Names shared by the tokenizer modules: GGUF token types and SentencePiece's marks."""

from __future__ import annotations

import re

# GGUF token types (llama.cpp's llama_token_type; the same numbers as SentencePiece's proto).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SPACE = "\u2581"  # SentencePiece's visible space
BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte-fallback pieces
