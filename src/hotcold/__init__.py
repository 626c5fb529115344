"""hotcold: fast local inference for activation-sparse LLMs (the PowerInfer design, in Python)."""

from hotcold.api import Model, load

__version__ = "0.1.0"
__all__ = ["Model", "load", "__version__"]
