"""hotcold: fast local inference for activation-sparse LLMs (the PowerInfer design, in Python)."""

import os

# OpenMP workers wait between parallel regions. libgomp's default (spin ~300k rounds, then sleep) once
# stalled every region ~8 ms on a busy 2-core VM; fully passive waiting (sleep at once) costs a futex
# wake-up of ~15 us per region, and a decode step has hundreds of regions. A short spin (1000 rounds,
# tens of microseconds) bridges the gap between one kernel and the next: measured on 2 cores, the
# bundled model decodes 375 instead of 275 tokens/s with 2 threads, the 1B synthetic 23.4 instead of
# 21.4, and 4 threads on 2 cores lose nothing. Set before torch loads libgomp; a user's own
# OMP_WAIT_POLICY or GOMP_SPINCOUNT wins, and importing torch before hotcold keeps torch's defaults.
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "1000"
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from hotcold.api import Model, load

__version__ = "0.1.0"
__all__ = ["Model", "load", "__version__"]
