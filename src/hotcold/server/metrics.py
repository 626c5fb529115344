"""Server counters, rendered in the Prometheus text format at `/metrics`."""

from __future__ import annotations

import threading
import time
from collections import Counter, deque

from hotcold.server.figures import storage_lines

WINDOW_S = 10.0  # tokens/s gauge: generated tokens over the last WINDOW_S seconds


class Metrics:
    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self.requests: Counter[tuple[str, int]] = Counter()  # (route, status) -> count
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) within the window

    def request_done(self, route: str, status: int) -> None:
        with self._lock:
            self.requests[(route, status)] += 1

    def prompt(self, n_tokens: int) -> None:
        with self._lock:
            self.prompt_tokens += n_tokens

    def tokens(self, n_tokens: int) -> None:
        """Called from worker threads as tokens are generated."""
        now = self._clock()
        with self._lock:
            self.generated_tokens += n_tokens
            self._recent.append((now, n_tokens))
            self._trim(now)

    def tokens_per_second(self) -> float:
        now = self._clock()
        with self._lock:
            self._trim(now)
            return sum(n for _, n in self._recent) / WINDOW_S

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - WINDOW_S:
            self._recent.popleft()

    def render(
        self,
        *,
        queue_depth: int,
        busy: int,
        parallel: int,
        cancelled: int,
        kv_usage: float = 0.0,
        vram=None,
        storage=None,
    ) -> str:
        """vram: the model's loader.VramFigures (None, or no parts: no GPU in use; the gauges read 0)."""
        tps = self.tokens_per_second()
        with self._lock:
            requests = sorted(self.requests.items())
            prompt, generated = self.prompt_tokens, self.generated_tokens
        lines = [
            "# HELP hotcold_requests_total HTTP requests answered, by route and status code.",
            "# TYPE hotcold_requests_total counter",
            *(f'hotcold_requests_total{{route="{r}",status="{s}"}} {n}' for (r, s), n in requests),
            "# HELP hotcold_prompt_tokens_total Prompt tokens of generation requests.",
            "# TYPE hotcold_prompt_tokens_total counter",
            f"hotcold_prompt_tokens_total {prompt}",
            "# HELP hotcold_generated_tokens_total Tokens generated.",
            "# TYPE hotcold_generated_tokens_total counter",
            f"hotcold_generated_tokens_total {generated}",
            f"# HELP hotcold_tokens_per_second Tokens generated per second, all slots, over the last {WINDOW_S:g} s.",
            "# TYPE hotcold_tokens_per_second gauge",
            f"hotcold_tokens_per_second {tps:.3f}",
            "# HELP hotcold_queue_depth Requests waiting for a free slot.",
            "# TYPE hotcold_queue_depth gauge",
            f"hotcold_queue_depth {queue_depth}",
            "# HELP hotcold_slots_busy Slots generating now.",
            "# TYPE hotcold_slots_busy gauge",
            f"hotcold_slots_busy {busy}",
            "# HELP hotcold_slots_total Slots (--parallel).",
            "# TYPE hotcold_slots_total gauge",
            f"hotcold_slots_total {parallel}",
            "# HELP hotcold_requests_cancelled_total Generations stopped because their client went away.",
            "# TYPE hotcold_requests_cancelled_total counter",
            f"hotcold_requests_cancelled_total {cancelled}",
            # the names routers and orchestrators already read (vLLM's for the Gateway API inference
            # extension and Ray Serve LLM, llama.cpp's for its users' dashboards), with their meanings
            "# HELP vllm:num_requests_running Requests in the running batch.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running {busy}",
            "# HELP vllm:num_requests_waiting Requests waiting to join the batch.",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting {queue_depth}",
            "# HELP vllm:gpu_cache_usage_perc KV cache usage, 1 = full (positions held over all slots; CPU or GPU).",
            "# TYPE vllm:gpu_cache_usage_perc gauge",
            f"vllm:gpu_cache_usage_perc {kv_usage:.4f}",
            "# HELP llamacpp:prompt_tokens_total Prompt tokens of generation requests.",
            "# TYPE llamacpp:prompt_tokens_total counter",
            f"llamacpp:prompt_tokens_total {prompt}",
            "# HELP llamacpp:tokens_predicted_total Tokens generated.",
            "# TYPE llamacpp:tokens_predicted_total counter",
            f"llamacpp:tokens_predicted_total {generated}",
            *vram_lines(vram),
            *storage_lines(storage),  # under a RAM budget: bytes read from the model file, the neuron cache
        ]
        return "\n".join(lines) + "\n"


def vram_lines(vram) -> list[str]:
    """VRAM planned (the load plan's total, and by part) vs used (CUDA's caching allocator, this process)."""
    planned = vram.planned if vram is not None else {}
    used = vram.used if vram is not None and vram.used is not None else 0
    peak = vram.peak_reserved if vram is not None and vram.peak_reserved is not None else 0
    lines = [
        "# HELP hotcold_vram_planned_bytes VRAM the load plan budgets: placed tensors, KV cache, prefill "
        "scratch, hot rows (0 without a GPU).",
        "# TYPE hotcold_vram_planned_bytes gauge",
        f"hotcold_vram_planned_bytes {sum(planned.values())}",
    ]
    if planned:
        lines += [
            "# HELP hotcold_vram_planned_part_bytes The load plan's VRAM by part.",
            "# TYPE hotcold_vram_planned_part_bytes gauge",
            *(f'hotcold_vram_planned_part_bytes{{part="{k}"}} {v}' for k, v in planned.items()),
        ]
    return lines + [
        "# HELP hotcold_vram_used_bytes VRAM this process has allocated now (torch.cuda.memory_allocated; 0 "
        "without a GPU).",
        "# TYPE hotcold_vram_used_bytes gauge",
        f"hotcold_vram_used_bytes {used}",
        "# HELP hotcold_vram_reserved_peak_bytes The most VRAM the caching allocator has reserved "
        "(torch.cuda.max_memory_reserved; 0 without a GPU).",
        "# TYPE hotcold_vram_reserved_peak_bytes gauge",
        f"hotcold_vram_reserved_peak_bytes {peak}",
    ]
