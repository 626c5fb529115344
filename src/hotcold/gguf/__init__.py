"""GGUF files: reading and writing them (io), checking them (check), their quant formats (quants, kquants)
and tensor names (names)."""
