"""hotcold: fast local inference for activation-sparse LLMs (the PowerInfer design, in Python)."""

import os

# OpenMP workers wait between parallel regions. libgomp's default (spin ~300k rounds, then sleep) once
# stalled every region ~8 ms on a busy 2-core VM; fully passive waiting (sleep at once) costs a futex
# wake-up of ~15-20 us per region, and a decode step has hundreds of regions. A bounded spin (10k rounds:
# a worker still answers in ~1 us after 100 us idle, ~19 us after 400 us, measured on the 2-core VM)
# bridges the gap between one kernel and the next: measured on 2 cores, the
# 1B synthetic decodes 21.4 tok/s passive, 23.4 with 1k rounds and a further ~3% with 10k; 4 threads
# on 2 cores lose nothing (libgomp throttles spinning when oversubscribed). Set before torch loads
# libgomp; a user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT wins, and importing torch before hotcold
# keeps torch's defaults.
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "10000"
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from hotcold.api import Model, load

__version__ = "0.1.0"
__all__ = ["Model", "load", "__version__"]
