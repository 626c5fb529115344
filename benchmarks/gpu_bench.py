"""benchmarks/gpu.py's frame: the results file (every required field, saved after each change), the parts run
under a global deadline with their own limits, child processes killed with everything they started, and a
watchdog that saves and exits whatever hangs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
GIB = 1 << 30
# fields every gpu.json has (null when not measured); the GPU issues judge these
REQUIRED = (
    "gpu", "date", "copy_gb_s", "host_copy_gb_s", "h2d_pinned_gb_s",
    "dense_all_gpu_tps", "dense_all_gpu_gb_s", "sparse_all_gpu_tps", "sparse_all_gpu_gb_s",
    "pi_dense_all_gpu_tps", "pi_sparse_all_gpu_tps", "budget_gib", "ngl", "hybrid_tps", "dense_ngl_tps",
    "sparse_cpu_only_tps", "pi_hybrid_tps", "pi_dense_ngl_tps", "pi_sparse_cpu_only_tps", "vram_used_gib",
    "dense_all_gpu_share_of_copy", "sparse_over_dense_all_gpu", "hybrid_over_dense_ngl",
    "hybrid_over_pi_hybrid", "sparse_all_gpu_over_pi", "dense_all_gpu_over_pi", "dense_ngl_over_pi",
    "sparse_cpu_only_over_pi", "pi_hybrid_over_pi_dense_ngl", "pi_hybrid_equal_bytes_tps",
    "hybrid_over_pi_hybrid_equal_bytes", "pi_equal_bytes_budget_gib", "dense_bytes_per_token",
    "sparse_bytes_per_token", "sparse_bytes_ceiling", "sparse_share_of_ceiling", "errors",
)  # fmt: skip
RATIOS = {  # name: (numerator, denominator)
    "dense_all_gpu_share_of_copy": ("dense_all_gpu_gb_s", "copy_gb_s"),
    "sparse_over_dense_all_gpu": ("sparse_all_gpu_tps", "dense_all_gpu_tps"),
    "hybrid_over_dense_ngl": ("hybrid_tps", "dense_ngl_tps"),
    "hybrid_over_pi_hybrid": ("hybrid_tps", "pi_hybrid_tps"),  # the same flags (-c too)
    "hybrid_over_pi_hybrid_equal_bytes": ("hybrid_tps", "pi_hybrid_equal_bytes_tps"),  # the same hot bytes
    "sparse_bytes_ceiling": ("dense_bytes_per_token", "sparse_bytes_per_token"),  # sparse / dense by bytes
    "sparse_all_gpu_over_pi": ("sparse_all_gpu_tps", "pi_sparse_all_gpu_tps"),
    "dense_all_gpu_over_pi": ("dense_all_gpu_tps", "pi_dense_all_gpu_tps"),
    "dense_ngl_over_pi": ("dense_ngl_tps", "pi_dense_ngl_tps"),
    "sparse_cpu_only_over_pi": ("sparse_cpu_only_tps", "pi_sparse_cpu_only_tps"),
    "pi_hybrid_over_pi_dense_ngl": ("pi_hybrid_tps", "pi_dense_ngl_tps"),
}


class PartTimeout(Exception):
    pass


def _raise_timeout(signum, frame):
    raise PartTimeout()


def kill_tree(pid: int) -> None:
    """End a child we started and everything under it (GNU timeout moves itself to a process group of its
    own, so a group kill would miss PowerInfer's main): SIGTERM to each, then SIGKILL to what is left."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    alive = tree
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in alive:
            try:
                os.kill(p, sig)
            except OSError:
                pass
        for _ in range(20 if sig == signal.SIGTERM else 0):  # up to 2 s to go quietly
            alive = [p for p in alive if _running(p)]
            if not alive:
                return
            time.sleep(0.1)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"  # a zombie is gone (its parent reaps it)


class Bench:
    """The results dict, saved after every change; parts run under the deadline."""

    def __init__(self, out: Path, deadline_s: float):
        self.out, self.deadline_s, self.t0 = out, deadline_s, time.monotonic()
        self.results: dict = {k: None for k in REQUIRED}
        self.results.update(errors={}, skipped={}, part_seconds={}, runs={})
        self.lock = threading.RLock()
        self.procs: set[subprocess.Popen] = set()

    def left(self) -> float:
        return self.deadline_s - (time.monotonic() - self.t0)

    def save(self) -> None:
        with self.lock:
            self.results["elapsed_s"] = round(time.monotonic() - self.t0, 1)
            self.out.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.out.with_name(self.out.name + ".tmp")
            tmp.write_text(json.dumps(self.results, indent=2, default=str))
            tmp.replace(self.out)

    def set(self, **fields) -> None:
        with self.lock:
            self.results.update(fields)
        self.save()

    def note(self, table: str, key: str, text: str) -> None:
        with self.lock:
            self.results[table][key] = text
        print(f"gpu.py: {table} {key}: {text}", file=sys.stderr, flush=True)
        self.save()

    def part(self, name: str, fn, *, need_s: float, limit_s: float):
        """Run fn() unless less than need_s is left; stop it after limit_s (or at the deadline)."""
        left = self.left()
        if left < need_s:
            self.note(
                "skipped", name, f"{left:.0f} s left before the deadline, the part needs ~{need_s:.0f} s"
            )
            return None
        limit = max(1.0, min(limit_s, left))
        start = time.monotonic()
        print(f"gpu.py: {name} (limit {limit:.0f} s, {left:.0f} s left)", file=sys.stderr, flush=True)
        alarm = threading.current_thread() is threading.main_thread()
        if alarm:
            previous = signal.signal(signal.SIGALRM, _raise_timeout)
            signal.setitimer(signal.ITIMER_REAL, limit)
        try:
            return fn()
        except PartTimeout:
            self.note("errors", name, f"stopped at its time limit ({limit:.0f} s)")
        except Exception as exc:  # record and go on: one failure must not lose the other figures
            self.note("errors", name, f"{type(exc).__name__}: {exc}"[:1500])
            with self.lock:
                self.results.setdefault("tracebacks", {})[name] = traceback.format_exc()[-3000:]
        finally:
            if alarm:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)
            with self.lock:
                self.results["part_seconds"][name] = round(time.monotonic() - start, 1)
            self.save()
        return None

    def run_proc(self, cmd, *, limit_s: float, env=None, on_line=None, cwd=REPO) -> tuple[int | None, str]:
        """A child process (its own session), stdout+stderr read line by line; killed, with everything it
        started, at limit_s. (return code or None when killed, the output's tail)"""
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True, errors="replace",
        )  # fmt: skip
        self.procs.add(proc)
        lines: list[str] = []

        def read():
            for line in proc.stdout:
                lines.append(line)
                if on_line is not None:
                    on_line(line)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            if proc.poll() is None:
                kill_tree(proc.pid)
                proc.wait()
            self.procs.discard(proc)
            reader.join(timeout=5)
        return rc, "".join(lines)[-4000:]

    def watchdog(self, hard_s: float) -> threading.Event:
        """At hard_s after the start, whatever hangs: save, end our children, exit (rc 124)."""
        done = threading.Event()

        def watch():
            if done.wait(max(0.0, hard_s - (time.monotonic() - self.t0))):
                return
            self.note("errors", "watchdog", f"hard stop at {hard_s:.0f} s (a part hung past its limit)")
            for proc in list(self.procs):
                kill_tree(proc.pid)
            try:
                from benchmarks.gpu_summary import summary

                with self.lock:
                    print(summary(self.results), flush=True)
            except Exception:  # the main thread may be anywhere
                pass
            os._exit(124)

        threading.Thread(target=watch, daemon=True).start()
        return done


def finish(b: Bench) -> None:
    with b.lock:
        r = b.results
        for field, run in (
            ("dense_bytes_per_token", "dense_all_gpu"),
            ("sparse_bytes_per_token", "sparse_all_gpu"),
        ):
            r[field] = r["runs"].get(run, {}).get("bytes_per_token")
        for key, (num, den) in RATIOS.items():
            r[key] = r[num] / r[den] if r.get(num) and r.get(den) else None
        # the sparse target: sparse / dense all-GPU against what the bytes allow (>= 0.8)
        got, ceiling = r.get("sparse_over_dense_all_gpu"), r.get("sparse_bytes_ceiling")
        r["sparse_share_of_ceiling"] = got / ceiling if got and ceiling else None
        hybrid = r["runs"].get("hybrid", {})
        r["vram_used_gib"] = hybrid.get("vram_peak_reserved_gib")
        r["vram_allocated_gib"] = hybrid.get("vram_peak_allocated_gib")
    b.save()
