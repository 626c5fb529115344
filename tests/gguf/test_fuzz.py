"""Fuzz the model-file reader with structure-aware mutations of tiny model files.

Two tiny models are written here (a dense GGUF and a PowerInfer PWRI file with predictors). Their layout
is walked to find every field (header counts, metadata keys / types / lengths / array counts / values,
tensor names / dimension counts / dimensions / types / data offsets), and each mutation rewrites one or a
few of them with values chosen to hurt (0, 1, 2**32, 2**40, 2**63, 2**64-1, off by one, another tensor's
offset, NaN, ...), or flips bytes, truncates or splices the header. Every mutated file is opened the way
people open one: `hotcold info` (ModelFile + config), `hotcold.load` and a three-token forward.

A mutation passes when it loads and runs, or fails with our clear errors (ValueError subclasses, GGUFError
among them, with a message). It fails on any other exception (a traceback), a signal (segfault, abort), a
hang (no progress for HANG_S) or memory blow-up (children run under an address-space limit, so an
unbounded allocation raises instead of swapping). Mutations run in a few child processes, each looping
over its share and reporting one JSON line per mutation; a child that dies or hangs is replaced and the
mutation it was on is reported.

    pytest tests/gguf/test_fuzz.py                          # the CI run: N_CI mutations, seed SEED_CI
    python tests/gguf/test_fuzz.py --n 10000 --seed 7       # a long run; prints a summary
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

if __name__ == "__main__":  # script mode: make `tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.fixtures import GGUFField, get_field, gguf_layout, set_field, tiny_gguf  # noqa: E402

SEED_CI = 20240615
N_CI = 300
HANG_S = 20.0  # no progress from a child for this long: the mutation in hand hangs
STARTUP_S = 300.0  # a child's imports (torch) on a busy machine
MEMORY_HEADROOM = 2 << 30  # bytes of address space a child may add on top of what its imports took
SPECIAL_U64 = [
    0,
    1,
    2,
    3,
    7,
    31,
    32,
    33,
    2**31,
    2**32 - 1,
    2**32,
    2**40,
    2**62,
    2**63 - 1,
    2**63,
    2**64 - 2,
    2**64 - 1,
]
SPECIAL_U32 = [0, 1, 2, 3, 8, 12, 13, 16, 17, 18, 26, 30, 31, 255, 2**16, 2**31 - 1, 2**31, 2**32 - 1]
SPECIAL_F32 = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, -1.0, 1e-45, 3.4e38]

# ---------------------------------------------------------------------------------------------------
# Mutations


def mutate(data: bytes, fields: list[GGUFField], data_start: int, rng: random.Random) -> tuple[bytes, str]:
    """One mutated copy of `data` and a description of what was done."""
    buf = bytearray(data)
    kind = rng.choices(
        ["field", "fields", "offset", "string", "flip", "truncate", "splice", "data"],
        weights=[9, 3, 3, 2, 2, 1, 1, 1],
    )[0]
    if kind in ("field", "fields"):
        done = []
        for _ in range(1 if kind == "field" else rng.randint(2, 5)):
            # weight the interesting roles: counts and lengths are few but matter most
            role = rng.choice(
                ["count", "length", "type", "value", "value", "item", "dim", "n_dims", "offset", "version"]
            )
            pool = [f for f in fields if f.role == role] or fields
            f = rng.choice(pool)
            old = get_field(data, f)
            if f.fmt in "fd":
                new = rng.choice(SPECIAL_F32 + [old * 2, -old])
            elif f.fmt in "QqBb" or f.fmt in "?":
                new = rng.choice(SPECIAL_U64 + [old + 1, old - 1, old * 2, old + 32, rng.getrandbits(64)])
            else:
                new = rng.choice(SPECIAL_U32 + [old + 1, old - 1, old * 2, rng.getrandbits(32)])
            set_field(buf, f, new)
            done.append(f"{f.label}={new!r}")
        return bytes(buf), f"{kind}: " + ", ".join(done)
    if kind == "offset":
        offsets = [f for f in fields if f.role == "offset"]
        f = rng.choice(offsets)
        old = get_field(data, f)
        other = get_field(data, rng.choice(offsets))
        size = len(data) - data_start
        new = rng.choice(
            [other, other + 32, old + 1, old - 32, old + 32, size, size - 32, 2**64 - 32, 2**64 - old, 2**63]
        )
        set_field(buf, f, new)
        return bytes(buf), f"offset: {f.label}={new}"
    if kind == "string":  # a key, name or value rewritten in place: other text, invalid UTF-8, NULs
        f = rng.choice([f for f in fields if f.role == "length"])
        n = get_field(data, f)
        start = f.offset + 8
        if n:
            pick = rng.choice(["random", "ascii", "nul", "name"])
            if pick == "random":
                new = os.urandom(n)
            elif pick == "nul":
                new = bytes(n)
            else:
                alphabet = "abcdefghijklmnopqrstuvwxyz._0123456789" if pick == "ascii" else "llamgpt2.fc"
                new = "".join(rng.choice(alphabet) for _ in range(n)).encode()
            buf[start : start + n] = new
        return bytes(buf), f"string: {f.label} ({n} bytes) rewritten"
    if kind == "flip":
        n = rng.randint(1, 8)
        for _ in range(n):
            i = rng.randrange(4, data_start)
            buf[i] = rng.getrandbits(8)
        return bytes(buf), f"flip {n} header bytes"
    if kind == "truncate":
        cut = rng.randrange(0, len(data))
        return bytes(buf[:cut]), f"truncate at {cut}"
    if kind == "splice":
        a, b = sorted(rng.randrange(4, data_start) for _ in range(2))
        if rng.random() < 0.5:
            return bytes(buf[:a] + buf[b:]), f"delete header bytes {a}..{b}"
        return bytes(buf[:a] + os.urandom(rng.randint(1, 64)) + buf[a:]), f"insert bytes at {a}"
    # data: garbage in the tensor bytes (NaN, huge values): must still load and run without a crash
    for _ in range(32):
        i = rng.randrange(data_start, len(data))
        buf[i] = 0xFF
    return bytes(buf), "data bytes set to 0xff"


# ---------------------------------------------------------------------------------------------------
# Child: open many mutated files, one JSON line per mutation


def open_like_people(path: str) -> None:
    import hotcold
    from hotcold.cli.info import describe

    describe(path)
    llm = hotcold.load(path, device="cpu", threads=1)
    llm.logits([1, 5, 6])


def child_main(work: str, bases: list[str], seed: int, start: int, stop: int) -> None:
    import resource

    import hotcold  # noqa: F401 (imports first: the address-space limit is for the work, not for torch)
    from hotcold.cli.info import describe  # noqa: F401
    from hotcold.kernels import cpu

    cpu.backend()
    with open("/proc/self/statm") as f:
        vm = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (vm + MEMORY_HEADROOM, resource.RLIM_INFINITY))
    originals = [Path(b).read_bytes() for b in bases]
    layouts = [gguf_layout(d) for d in originals]
    target = Path(work) / f"m{os.getpid()}.gguf"
    print(json.dumps({"ready": True}), flush=True)
    for i in range(start, stop):
        rng = random.Random(f"{seed}:{i}")
        which = rng.randrange(len(originals))
        data, what = mutate(originals[which], *layouts[which], rng)
        target.write_bytes(data)
        print(json.dumps({"i": i, "start": True}), flush=True)
        t0 = time.perf_counter()
        outcome, message = "ok", ""
        try:
            open_like_people(str(target))
        except ValueError as exc:  # GGUFError and the other clear refusals
            outcome, message = (
                ("clear", str(exc)) if str(exc).strip() else ("bad", "ValueError without a message")
            )
        except Exception as exc:
            import traceback

            outcome, message = "bad", "".join(traceback.format_exception(exc))[-2000:]
        print(
            json.dumps(
                {
                    "i": i,
                    "base": Path(bases[which]).name,
                    "what": what,
                    "outcome": outcome,
                    "message": message[:2000],
                    "seconds": round(time.perf_counter() - t0, 3),
                }
            ),
            flush=True,
        )
    target.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------------
# Parent: share the mutations among children, watch them


def _spawn(work: str, bases: list[str], seed: int, start: int, stop: int, err) -> subprocess.Popen:
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", work, json.dumps(bases)]
    cmd += [str(seed), str(start), str(stop)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=env, bufsize=0)


def describe_mutation(bases: list[str], seed: int, i: int) -> str:
    """What mutation i did (recomputed: mutations are a function of the seed and the index)."""
    rng = random.Random(f"{seed}:{i}")
    which = rng.randrange(len(bases))
    data = Path(bases[which]).read_bytes()
    return f"{Path(bases[which]).name}: " + mutate(data, *gguf_layout(data), rng)[1]


@dataclass
class _Child:
    lo: int  # first mutation of its share it has not finished
    hi: int
    err: Path  # its stderr
    last: float = field(default_factory=time.monotonic)  # last sign of life
    current: int | None = None  # the mutation in hand
    ready: bool = False  # imports done: from here on HANG_S applies
    pending: bytes = b""  # output read but not yet a whole line


def run_fuzz(n: int, seed: int, *, workers: int = 2, first: int = 0, work: str | None = None) -> list[dict]:
    """Run mutations first .. first+n-1 with `workers` children; one result per mutation, in order."""
    import selectors

    from hotcold.kernels import cpu

    cpu.backend()  # compile the C kernels once, here, not in every child's first seconds
    with tempfile.TemporaryDirectory(prefix="hotcold-fuzz-", dir=work) as tmp:
        bases = [
            str(tiny_gguf(Path(tmp) / "dense.gguf", sparse=False)),
            str(tiny_gguf(Path(tmp) / "sparse.powerinfer.gguf", sparse=True)),
        ]
        share = -(-n // workers)
        results: dict[int, dict] = {}
        sel = selectors.DefaultSelector()
        children: dict[subprocess.Popen, _Child] = {}

        def start(lo: int, hi: int) -> None:
            if lo >= hi:
                return
            err = Path(tmp) / f"err-{lo}.txt"
            with open(err, "w") as f:
                proc = _spawn(tmp, bases, seed, lo, hi, f)
            children[proc] = _Child(lo, hi, err)
            sel.register(proc.stdout, selectors.EVENT_READ, proc)

        def retire(proc: subprocess.Popen, outcome: str, detail: str) -> None:
            sel.unregister(proc.stdout)
            child = children.pop(proc)
            if child.current is None:  # not a mutation's doing: a broken setup, do not loop on it
                raise RuntimeError(f"fuzz child for mutations {child.lo}..{child.hi} failed: {detail}")
            what = describe_mutation(bases, seed, child.current)
            results[child.current] = {"i": child.current, "what": what, "outcome": outcome, "message": detail}
            start(child.current + 1, child.hi)

        for lo in range(first, first + n, share):
            start(lo, min(first + n, lo + share))
        while children:
            for key, _ in sel.select(timeout=1.0):
                proc = key.data
                child = children[proc]
                data = os.read(proc.stdout.fileno(), 1 << 16)  # all there is: lines often come two at once
                if not data:  # the child ended: normally, or by a signal / crash
                    code = proc.wait()
                    if code == 0 and child.current is None:
                        sel.unregister(proc.stdout)
                        children.pop(proc)
                    else:
                        why = f"signal {-code}" if code < 0 else f"exit {code}"
                        retire(proc, "crash", f"child died ({why}): {child.err.read_text()[-2000:]}")
                    continue
                *lines, child.pending = (child.pending + data).split(b"\n")
                child.last = time.monotonic()
                for line in lines:
                    record = json.loads(line)
                    if record.get("ready"):
                        child.ready = True
                    elif record.get("start"):
                        child.current = record["i"]
                    else:
                        results[record["i"]] = record
                        child.current = None
            for proc, child in list(children.items()):
                limit = HANG_S if child.ready else STARTUP_S
                if time.monotonic() - child.last > limit:
                    proc.kill()
                    proc.wait()
                    retire(proc, "hang", f"no progress for {limit:.0f} s")
        return [results[i] for i in sorted(results)]


def failures(results: list[dict]) -> list[dict]:
    return [r for r in results if r["outcome"] not in ("ok", "clear")]


def summary(results: list[dict]) -> str:
    counts = Counter(r["outcome"] for r in results)
    slowest = max((r.get("seconds", 0.0) for r in results), default=0.0)
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) + f"; slowest mutation {slowest:.2f} s"


# ---------------------------------------------------------------------------------------------------
# The CI test


def test_fuzzed_files_fail_clearly():
    start = time.perf_counter()
    results = run_fuzz(N_CI, SEED_CI, workers=2)
    seconds = time.perf_counter() - start
    bad = failures(results)
    assert len(results) == N_CI
    assert not bad, f"{len(bad)} of {N_CI} mutations failed badly (seed {SEED_CI}):\n" + "\n".join(
        f"#{r['i']} [{r.get('what', '?')}] {r['outcome']}: {r['message']}" for r in bad[:5]
    )
    counts = Counter(r["outcome"] for r in results)
    assert counts["clear"] > N_CI // 2  # the mutations do hit the checks
    assert seconds < 60, f"the fuzz run took {seconds:.0f} s"


def test_layout_finds_every_field(tmp_path):
    """The mutator's view of the file agrees with the reader's: every tensor's offset field is found."""
    from hotcold.gguf.io import ModelFile

    path = tiny_gguf(tmp_path / "m.gguf", sparse=True)
    data = path.read_bytes()
    fields, data_start = gguf_layout(data)
    mf = ModelFile(path)
    assert data_start == mf.header.data_offset
    assert sum(f.role == "offset" for f in fields) == len(mf.tensors)
    assert fields[-1].role == "offset"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=N_CI)
    parser.add_argument("--seed", type=int, default=SEED_CI)
    parser.add_argument("--first", type=int, default=0, help="index of the first mutation (to rerun one)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", default=None, help="write every result to this file")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    results = run_fuzz(args.n, args.seed, workers=args.workers, first=args.first)
    bad = failures(results)
    print(f"{args.n} mutations, seed {args.seed}, {time.perf_counter() - start:.0f} s: {summary(results)}")
    for r in bad[:20]:
        print(f"#{r['i']} [{r.get('what', '?')}] {r['outcome']}: {r['message']}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        work, bases, seed, lo, hi = sys.argv[2:7]
        child_main(work, json.loads(bases), int(seed), int(lo), int(hi))
    else:
        sys.exit(main())
