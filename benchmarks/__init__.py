"""Benchmark scripts (each prints JSON; `RESULTS.md` beside them records the figures we quote).

A package, so that scripts import each other as `benchmarks.NAME` and tests import them the same way:
never by putting this folder on `sys.path`, where a file's name would shadow an installed top-level package
(`kernels.py` once hid Hugging Face's `kernels`, which `transformers` imports).
"""
