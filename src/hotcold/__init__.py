"""hotcold: fast local inference for activation-sparse LLMs (the PowerInfer design, in Python)."""

import os

# Measured on 2 cores: with libgomp's default active spin-waiting, every OpenMP region called from the
# main thread stalled ~8 ms (a 12M model decoded at 3 tokens/s; 195 with passive waiting). Set before torch
# loads libgomp; a user's own setting wins, and importing torch before hotcold keeps torch's default.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from hotcold.api import Model, load

__version__ = "0.1.0"
__all__ = ["Model", "load", "__version__"]
