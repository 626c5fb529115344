"""hotcold.api.Model: shared between threads, and batched generation equal to one at a time."""

from __future__ import annotations

import threading

import pytest

import hotcold

PROMPTS = ["In the beginning", "And God said, Let there be", "Blessed are the meek: for they", "Jesus wept"]


@pytest.fixture(scope="module")
def llm():
    return hotcold.load(device="cpu", threads=2)


def test_generate_batch_equals_generate_alone(llm):
    kwargs = dict(max_tokens=20, temperature=0.8, seed=[1, 2, 3, 4], ignore_eos=True)
    batch = llm.generate_batch(PROMPTS, **kwargs)
    alone = [
        llm.generate(p, max_tokens=20, temperature=0.8, seed=s, ignore_eos=True)
        for p, s in zip(PROMPTS, [1, 2, 3, 4])
    ]
    assert batch == alone and len(set(batch)) == len(PROMPTS)
    stats = llm.last_batch_stats
    assert [s.generated_tokens for s in stats] == [20] * 4
    assert all(0 < s.firing_rate < 1 for s in stats)
    assert llm.generate_batch(PROMPTS[:2], max_tokens=0) == ["", ""]


def test_generate_batch_prompts_sharing_a_start_compute_it_once(llm):
    """Three prompts of ~60 tokens sharing their first 50, too many for one forward: the first prefills them, the
    others copy its rows and compute only their own tails; each result equals generate alone."""
    base = llm.tokenize(" ".join(PROMPTS * 8))[:50]
    tails = [llm.tokenize(p)[1:11] for p in PROMPTS[1:]]
    prompts = [base + tail for tail in tails]
    batch = llm.generate_batch(prompts, max_tokens=6, ignore_eos=True)
    assert len(prompts[0]) + len(prompts[1]) > 95  # not one forward (batching.MAX_ROWS)
    assert [s.prompt_computed for s in llm.last_batch_stats] == [len(prompts[0])] + [
        len(p) - 50 for p in prompts[1:]
    ]
    assert batch == [llm.generate(p, max_tokens=6, ignore_eos=True) for p in prompts]


def test_threads_sharing_one_model_each_get_their_own_text(llm):
    """generate from several threads on one Model: the calls take turns on its context, never mix."""
    alone = [llm.generate(p, max_tokens=16) for p in PROMPTS]
    got = [None] * len(PROMPTS)
    start = threading.Barrier(len(PROMPTS))

    def worker(i):
        start.wait()
        got[i] = llm.generate(PROMPTS[i], max_tokens=16)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert got == alone


def test_a_second_stream_on_the_same_thread_is_refused(llm):
    first = llm.stream(PROMPTS[0], max_tokens=8)
    next(first)
    with pytest.raises(RuntimeError, match="already generating"):
        llm.generate(PROMPTS[1], max_tokens=2)
    first.close()
    assert llm.generate(PROMPTS[1], max_tokens=2)  # the turn was given back


def test_a_new_thread_with_an_ended_threads_id_waits_its_turn(llm):
    """Issue #47 D6: a thread id is reused once its thread has ended. A thread that left a stream open (handed
    to another thread) ends; a new thread with the same id must wait for the turn like any other thread,
    not be told it is "already generating"."""
    held = {}

    def start_a_stream():
        held["stream"] = llm.stream(PROMPTS[0], max_tokens=8)
        next(held["stream"])
        held["ident"] = threading.get_ident()

    first = threading.Thread(target=start_a_stream)
    first.start()
    first.join(timeout=120)
    result = {}

    def generate_if_same_id():
        if threading.get_ident() == held["ident"]:
            try:
                result["text"] = llm.generate(PROMPTS[1], max_tokens=2)
            except RuntimeError as exc:
                result["error"] = exc

    for _ in range(50):  # the next thread usually gets the ended one's id (its stack is reused)
        second = threading.Thread(target=generate_if_same_id)
        second.start()
        second.join(timeout=0.5)
        if second.is_alive() or result:
            break
    else:
        pytest.skip("no new thread got the ended thread's id")
    assert "error" not in result, result  # it waits: the stream still holds the turn
    held["stream"].close()
    second.join(timeout=120)
    assert result["text"]


def test_a_dropped_model_is_collected(tiny_dense_gguf):
    """load() takes the model's objects out of the collector's scans (gc.freeze: decode allocations no longer walk
    them); once the Model is dropped they go back (gc.unfreeze), so reloading models never accumulates them."""
    import gc
    import weakref

    llm = hotcold.load(tiny_dense_gguf, device="cpu")
    llm.generate("hi", max_tokens=2)
    inner = weakref.ref(llm.loaded.model)
    assert gc.get_freeze_count() > 0
    del llm
    gc.collect()
    assert inner() is None
