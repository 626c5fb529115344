"""How many slots a server opens, and the words it uses for them: `hotcold serve` without -np opens
llama-server's auto count (4) where their KV caches fit in memory, fewer where not."""

from __future__ import annotations

import httpx

from hotcold.cli.serve import AUTO_PARALLEL, cpu_kv_bytes, fit_slots
from hotcold.server.app import create_app
from tests.server.conftest import running

GIB = 1 << 30


def test_fit_slots_keeps_the_kv_caches_within_memory():
    assert AUTO_PARALLEL == 4  # llama-server: -np -1 ("auto") is 4 slots
    assert fit_slots(4, 1 * GIB, 64 * GIB) == 4
    assert fit_slots(4, 3 * GIB, 7 * GIB) == 2
    assert fit_slots(4, 8 * GIB, 2 * GIB) == 1  # never fewer than one
    assert fit_slots(4, 0, 0) == 4  # nothing in CPU memory (every layer's KV on the GPU, within its budget)


def test_cpu_kv_bytes_counts_every_cpu_layer(llm):
    c = llm.config
    expected = c.n_layer * 2 * llm.ctx_size * c.n_head_kv * c.head_dim * 4  # float32 K and V per position
    assert cpu_kv_bytes(llm) == expected


def test_n_above_the_slots_names_them_in_the_singular_or_plural(llm):
    for parallel, words in ((1, "at most 1 sequence at once"), (2, "at most 2 sequences at once")):
        with running(create_app(llm, parallel=parallel)) as url:
            r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 1, "n": 3}, timeout=30)
            assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
