"""Tokenizers from a GGUF file's vocabulary: the Tokenizer (vocab), SentencePiece-style (spm) and byte-level
(bpe) encoders, end-of-generation tokens (eog), shared types (types)."""
