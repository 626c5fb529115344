"""Models larger than memory (issue #48), in one call: decode speed inside a memory cgroup with the page cache
dropped before each run: hotcold with --ram-budget (sparse file) against llama.cpp's llama-bench (mmap, the dense
file of the same weights) and the original PowerInfer's (mmap, the sparse file; where built), each also without a
limit, and the disk's random-read rate at the queue depth hotcold reads at (HOTCOLD_READ_DEPTH, default 16) and at
1, and in 1 MiB sequential reads.

    python benchmarks/memory.py [--model SPARSE.gguf] [--dense-model DENSE.gguf] [--llama-bench BIN] \
        [--original-bench BIN] [--limit-gib 1.25] [--ram-budget 0.8] [-t 2] [-n 16] [-c 256] [--out JSON] \
        [--llama-args '--repack 0']

An MoE file (stacked experts) runs too: give it as both --model and --dense-model; hotcold then reads whole experts
(docs/larger-than-memory.md).

Needs root (cgroup v2 `memory.max` or v1 `memory.limit_in_bytes`, /proc/sys/vm/drop_caches). Every timed run
holds `flock /tmp/hotcold-bench.lock` (other people benchmark on the machine too). Prints JSON and writes it to
benchmarks/results/memory_<date>.json (or --out). Files: benchmarks/synth.py --shape 1b (sparse, its activation
statistics beside it) and --dense (the same weights in the dense layout).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

LOCK = "/tmp/hotcold-bench.lock"
ROOT = Path(__file__).resolve().parent.parent  # the child runs `python -m benchmarks.memory` from here
LLAMA_BENCH = Path.home() / ".cache/hotcold-anchors/llama.cpp/build/bin/llama-bench"
ORIGINAL_BENCH = Path.home() / ".cache/hotcold-anchors/powerinfer/build/bin/llama-bench"
PROMPT = "Once upon a time"


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


class MemoryCgroup:
    """A child memory cgroup of this process's own (v2, or v1's memory controller) with a hard limit and no swap;
    `preexec` moves a child process into it."""

    def __init__(self, limit_bytes: int, name: str):
        self.v2 = (
            Path("/sys/fs/cgroup/cgroup.controllers").exists()
            and "memory" in Path("/sys/fs/cgroup/cgroup.controllers").read_text().split()
        )
        own = ""
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            hier, ctrl, path = line.split(":", 2)
            if (self.v2 and hier == "0") or (not self.v2 and "memory" in ctrl.split(",")):
                own = path
        root = Path("/sys/fs/cgroup") if self.v2 else Path("/sys/fs/cgroup/memory")
        self.path = root / own.lstrip("/") / f"{name}-{os.getpid()}"
        self.path.mkdir()
        if self.v2:
            (self.path / "memory.max").write_text(str(limit_bytes))
            if (self.path / "memory.swap.max").exists():
                (self.path / "memory.swap.max").write_text("0")
        else:
            (self.path / "memory.limit_in_bytes").write_text(str(limit_bytes))
            memsw = self.path / "memory.memsw.limit_in_bytes"
            if memsw.exists():
                memsw.write_text(str(limit_bytes))

    def preexec(self) -> None:
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak_bytes(self) -> int | None:
        for name in ("memory.peak", "memory.max_usage_in_bytes"):
            if (self.path / name).exists():
                return int((self.path / name).read_text())
        return None

    def oom_kills(self) -> int | None:
        for name in ("memory.events", "memory.oom_control"):
            if (self.path / name).exists():
                for line in (self.path / name).read_text().splitlines():
                    if line.startswith("oom_kill "):
                        return int(line.split()[1])
        return None

    def remove(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def timed(cmd: list[str], *, limit_bytes: int | None, name: str) -> dict:
    """cmd under the lock, the page cache dropped just before, in a fresh cgroup when limit_bytes is set."""
    inner = "sync; echo 3 > /proc/sys/vm/drop_caches; exec " + " ".join(_quote(c) for c in cmd)
    full = ["flock", LOCK, "sh", "-c", inner]
    group = MemoryCgroup(limit_bytes, name) if limit_bytes else None
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            full, capture_output=True, text=True, preexec_fn=group.preexec if group else None
        )
        out = {"rc": proc.returncode, "wall_s": time.perf_counter() - t0}
        if group is not None:
            out |= {"cgroup_peak_bytes": group.peak_bytes(), "oom_kills": group.oom_kills()}
    finally:
        if group is not None:
            group.remove()
    out["killed"] = proc.returncode < 0 or proc.returncode == 137 or bool(out.get("oom_kills"))
    if proc.returncode == 0:
        out["stdout"] = proc.stdout
    else:
        out["stderr_tail"] = proc.stderr[-2000:]
    return out


def _quote(s: str) -> str:
    import shlex

    return shlex.quote(s)


def disk_rate(path: str, depth: int, *, seconds: float = 3.0, size: int = 4096) -> dict:
    """Random `size`-byte preads at `depth` threads over the file (page cache dropped first, no readahead)."""
    drop_caches()
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    blocks = os.fstat(fd).st_size // size
    stop = time.perf_counter() + seconds
    counts = [0] * depth

    def work(i: int) -> None:
        rng, buf = random.Random(i), memoryview(bytearray(size))
        while time.perf_counter() < stop:
            os.preadv(fd, [buf], rng.randrange(blocks) * size)
            counts[i] += 1

    t0 = time.perf_counter()
    threads = [threading.Thread(target=work, args=(i,)) for i in range(depth)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    os.close(fd)
    n = sum(counts)
    return {"depth": depth, "read_bytes": size, "MB_per_s": n * size / elapsed / 1e6, "iops": n / elapsed}


def sequential_rate(path: str, *, seconds: float = 3.0, size: int = 1 << 20) -> dict:
    drop_caches()
    fd, done, t0 = os.open(path, os.O_RDONLY), 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        got = os.pread(fd, size, done)
        if not got:
            break
        done += len(got)
    os.close(fd)
    return {"read_bytes": size, "MB_per_s": done / (time.perf_counter() - t0) / 1e6}


def child(args) -> int:
    """One hotcold run (inside the cgroup): load, a short prompt, n tokens; JSON on stdout."""
    from hotcold.storage.plan import process_rss

    before = process_rss()
    import resource

    import hotcold

    llm = hotcold.load(
        args.model, device="cpu", threads=args.threads, ctx_size=args.ctx, ram_budget=args.child_budget
    )
    llm.generate(PROMPT, max_tokens=1)  # the prompt's prefill; the timed call below reuses its cached prefix
    llm.generate(PROMPT, max_tokens=args.n_gen, ignore_eos=True)
    s = llm.last_stats  # its storage counts: the decode's (and the one prompt token run again)
    out = {
        "load_s": llm.load_seconds,
        "prompt_tokens": s.prompt_tokens,
        "tg_tokens_per_s": s.generate_tps,
        "decoder": llm.decoder,
        "rss_before_load_bytes": before,
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    storage = llm.loaded.storage
    if storage is not None:
        from hotcold.storage.rows import StorageStats

        out["plan"] = storage.plan.as_dict()
        out["request_storage"] = StorageStats.figures(s.storage)
        out["storage_bytes_per_token"] = out["request_storage"]["storage_bytes_per_token"]
    print(json.dumps(out))
    return 0


def hotcold_run(args, *, budget: float | None, limit: int | None, name: str) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.memory",
        "--child",
        "--model",
        args.model,
        "-t",
        str(args.threads),
    ]
    cmd += ["-n", str(args.n_gen), "-c", str(args.ctx)] + (["--child-budget", str(budget)] if budget else [])
    got = timed(cmd, limit_bytes=limit, name=name)
    if "stdout" in got:
        got |= json.loads(got.pop("stdout").strip().splitlines()[-1])
    return {"engine": "hotcold", "ram_budget_gib": budget, "limit_bytes": limit, **got}


def llama_run(args, *, limit: int | None, name: str) -> dict:
    cmd = [args.llama_bench, "-m", args.dense_model, "-p", "0", "-n", str(args.n_gen), "-r", "1"]
    cmd += ["-t", str(args.threads), "-o", "json", *args.llama_args.split()]
    got = timed(cmd, limit_bytes=limit, name=name)
    if "stdout" in got:
        got["tg_tokens_per_s"] = float(json.loads(got.pop("stdout"))[0]["avg_ts"])
    return {
        "engine": "llama.cpp llama-bench (mmap)",
        "llama_args": args.llama_args,
        "limit_bytes": limit,
        **got,
    }


def original_run(args, *, limit: int | None, name: str) -> dict:
    """The original PowerInfer's llama-bench on the sparse file (mmap, its predictors; -ngl 0: a CPU build loads
    files only so)."""
    cmd = [args.original_bench, "-m", args.model, "-p", "0", "-n", str(args.n_gen), "-r", "1", "-ngl", "0"]
    cmd += ["-t", str(args.threads), "-o", "json"]
    got = timed(cmd, limit_bytes=limit, name=name)
    if "stdout" in got:
        got["tg_tokens_per_s"] = float(json.loads(got.pop("stdout"))[0]["avg_ts"])
    return {"engine": "original PowerInfer llama-bench (mmap)", "limit_bytes": limit, **got}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="/tmp/bench/synth-1b.powerinfer.gguf", help="sparse PowerInfer file")
    ap.add_argument("--dense-model", default="/tmp/bench/synth-1b.dense.gguf", help="the same weights, dense")
    ap.add_argument("--llama-bench", default=str(LLAMA_BENCH))
    ap.add_argument(
        "--original-bench",
        default=str(ORIGINAL_BENCH),
        help="the original PowerInfer's llama-bench (../shared/anchors/build-powerinfer-cpu.sh); absent: not run",
    )
    ap.add_argument("--limit-gib", type=float, default=1.25, help="the cgroup's memory limit")
    ap.add_argument("--ram-budget", type=float, default=0.8, help="hotcold's --ram-budget inside it")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", "--n-gen", type=int, default=16)
    ap.add_argument("-c", "--ctx", type=int, default=256)
    ap.add_argument("--disk-seconds", type=float, default=3.0)
    ap.add_argument("--skip-unlimited", action="store_true", help="only the runs inside the cgroup")
    ap.add_argument(
        "--fraction-model",
        nargs="*",
        default=[],
        help="SPARSE[=DENSE] files also run with --ram-budget at --fractions of the sparse file's size (a cgroup of "
        "the budget + --overhead-gib), llama-bench on DENSE in the same cgroup",
    )
    ap.add_argument("--fractions", default="0.25,0.5,0.75")
    ap.add_argument("--overhead-gib", type=float, default=0.45, help="the cgroup's room above the budget")
    ap.add_argument("--out", default=None)
    ap.add_argument("--llama-args", default="", help="more llama-bench flags (e.g. '--repack 0': MXFP4 and Q4_0 "
                    "are repacked into anonymous memory by default, which a file larger than memory cannot take)")  # fmt: skip
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-budget", type=float, default=None, help=argparse.SUPPRESS)  # None: no RAM budget
    args = ap.parse_args(argv)
    if args.child:
        return child(args)
    limit = int(args.limit_gib * (1 << 30))
    depth = int(os.environ.get("HOTCOLD_READ_DEPTH", "16"))
    with open(LOCK, "w") as lock:
        import fcntl

        fcntl.flock(lock, fcntl.LOCK_EX)  # the disk figures too: nobody else's reads in them
        disk = [disk_rate(args.model, d, seconds=args.disk_seconds) for d in (1, depth)]
        disk.append(sequential_rate(args.model, seconds=args.disk_seconds))
    runs = []
    have_llama = Path(args.llama_bench).is_file() and Path(args.dense_model).is_file()
    have_original = Path(args.original_bench).is_file()
    if not args.skip_unlimited:
        runs.append(hotcold_run(args, budget=None, limit=None, name="hc-unlimited"))
        if have_llama:
            runs.append(llama_run(args, limit=None, name="llama-unlimited"))
        if have_original:
            runs.append(original_run(args, limit=None, name="original-unlimited"))
    runs.append(hotcold_run(args, budget=args.ram_budget, limit=limit, name="hc-budget"))
    if have_llama:
        runs.append(llama_run(args, limit=limit, name="llama-limited"))
    if have_original:
        runs.append(original_run(args, limit=limit, name="original-limited"))
    fraction_runs = []
    for item in args.fraction_model:
        sparse, _, dense = item.partition("=")
        size = Path(sparse).stat().st_size
        for f in (float(x) for x in args.fractions.split(",")):
            budget = round(f * size / (1 << 30), 3)
            cap = int((budget + args.overhead_gib) * (1 << 30))
            sub = argparse.Namespace(**{**vars(args), "model": sparse, "dense_model": dense})
            fraction_runs.append(
                {"fraction": f, **hotcold_run(sub, budget=budget, limit=cap, name="hc-fraction")}
            )
            if dense and Path(args.llama_bench).is_file():
                fraction_runs.append({"fraction": f, **llama_run(sub, limit=cap, name="llama-fraction")})
    limited = {r["engine"]: r.get("tg_tokens_per_s") for r in runs if r["limit_bytes"]}
    hc, ll = limited.get("hotcold"), limited.get("llama.cpp llama-bench (mmap)")
    orig = limited.get("original PowerInfer llama-bench (mmap)")
    result = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} cores "
        "(shared with other people's work)",
        "model": args.model,
        "dense_model": args.dense_model if have_llama else None,
        "limit_bytes": limit,
        "ram_budget_gib": args.ram_budget,
        "threads": args.threads,
        "n_gen": args.n_gen,
        "ctx": args.ctx,
        "disk": disk,
        "runs": runs,
        "hotcold_vs_llama_limited": hc / ll if hc and ll else None,
        "hotcold_vs_original_limited": hc / orig if hc and orig else None,
        "fraction_runs": fraction_runs,
    }
    text = json.dumps(result, indent=2)
    print(text)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%m%d_%H%M")
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / f"memory_{stamp}.json"
    out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
