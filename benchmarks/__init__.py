"""Benchmark scripts, each printing JSON. `RESULTS.md` beside them is the page of current figures; `RESULTS_LOG.md`
holds every dated measurement behind it.

A package, so that scripts import each other as `benchmarks.NAME` and tests import them the same way:
never by putting this folder on `sys.path`, where a file's name would shadow an installed top-level package
(`kernels.py` once hid Hugging Face's `kernels`, which `transformers` imports).
"""
