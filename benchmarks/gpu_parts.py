"""benchmarks/gpu.py's parts that start processes: the synthetic files (synth.py), a hotcold run in a child
process (gpu.py --one-run), the original PowerInfer's configurations (gpu_pi), and `pytest -m gpu`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.gpu_bench import HERE, REPO, Bench, kill_tree
from benchmarks.gpu_measure import decode_run, fused_kernels


def synth_files(b: Bench, args) -> tuple[Path, Path]:
    """The sparse and the dense file of one model (synth.py, the two in parallel; reused when complete)."""
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    stem = f"synth-{args.shape}-{args.layers}l" + (f"-v{args.vocab}" if args.vocab else "")
    sparse, dense = work / f"{stem}.powerinfer.gguf", work / f"{stem}.gguf"
    done = work / f"{stem}.done"
    if not done.exists():
        start = time.perf_counter()
        base = [sys.executable, str(HERE / "synth.py"), "--shape", args.shape, "--layers", str(args.layers)]
        base += ["--vocab", str(args.vocab)] if args.vocab else []
        procs = {
            name: subprocess.Popen(base + extra + ["-o", str(path)], stdout=subprocess.PIPE, text=True)
            for name, path, extra in (("sparse", sparse, []), ("dense", dense, ["--dense"]))
        }
        b.procs.update(procs.values())
        try:
            for name, proc in procs.items():
                out, _ = proc.communicate(
                    timeout=max(1.0, args.synth_limit_s - (time.perf_counter() - start))
                )
                if proc.returncode != 0:
                    raise RuntimeError(f"synth.py ({name}) exited {proc.returncode}")
                b.results.setdefault("synth", {})[name] = json.loads(out)
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    kill_tree(proc.pid)
                b.procs.discard(proc)
        b.set(synth_seconds=time.perf_counter() - start)
        done.write_text("ok\n")
    b.set(sparse_file=str(sparse), dense_file=str(dense), file_bytes=sparse.stat().st_size)
    return sparse, dense


def in_child(b: Bench, name: str, spec: dict, limit_s: float) -> dict:
    """one_run(spec) in a child process, killed at limit_s: a hang or a CUDA error that poisons the process
    then costs this part alone. Returns the child's record."""
    work = Path(b.out).parent if spec.get("workdir") is None else Path(spec["workdir"])
    spec_file, result_file = work / f"run-{name}.json", work / f"run-{name}.result.json"
    result_file.unlink(missing_ok=True)
    spec_file.write_text(json.dumps({**spec, "result": str(result_file)}))
    rc, tail = b.run_proc(
        [sys.executable, str(HERE / "gpu.py"), "--one-run", str(spec_file)], limit_s=limit_s
    )
    if not result_file.exists():
        why = "was stopped at its time limit" if rc is None else f"exited {rc}"
        raise RuntimeError(f"the child {why} without a result; its output ends: {tail[-1200:]}")
    return json.loads(result_file.read_text())


def run_config(b: Bench, name: str, path: Path, args, env: dict | None = None, **load_args) -> None:
    """One decode_run, in a child process when isolated (with `env` added to its environment), else in
    this process."""
    spec = dict(path=str(path), n_gen=args.n_gen, ctx=args.ctx, threads=args.threads, device=args.device)
    spec["warmup"] = args.warmup
    if (
        env
        or args.isolate == "all"
        or (args.isolate == "auto" and (args.device == "cuda" or name == "dense_all_gpu"))
    ):
        spec = dict(kind="decode", workdir=args.workdir, load_args=load_args, env=env or {}, **spec)
        record = in_child(b, name, spec, max(1.0, min(args.run_limit_s, b.left())))
        record["isolated"] = True
    else:
        record = decode_run(Path(spec.pop("path")), **spec, **load_args)
    with b.lock:
        b.results["runs"][name] = record
    b.set(**{f"{name}_tps": record["tps"], f"{name}_gb_s": record["gb_s"]})
    print(
        f"gpu.py: {name}: {record['tps']:.2f} tok/s, {record['gb_s']:.1f} GB/s", file=sys.stderr, flush=True
    )


def one_run(spec_file: str) -> int:
    """The child of an isolated part: decode_run or fused_kernels as the spec says, the record written
    where it says."""
    spec = json.loads(Path(spec_file).read_text())
    result = Path(spec.pop("result"))
    kind = spec.pop("kind")
    spec.pop("workdir", None)
    os.environ.update(spec.pop("env", {}))
    if kind == "decode":
        load_args = spec.pop("load_args")
        record = decode_run(Path(spec.pop("path")), **spec, **load_args)
    elif kind == "fused":
        record = fused_kernels(spec["device"])
    else:
        raise ValueError(f"{spec_file}: unknown kind {kind!r}")
    tmp = result.with_name(result.name + ".tmp")
    tmp.write_text(json.dumps(record, default=str))
    tmp.replace(result)
    return 0


def powerinfer(b: Bench, args, sparse: Path, dense: Path, limit_s: float) -> None:
    """The original's configurations (gpu_pi.pi_plan: every one at -c ctx; the hybrid at hotcold's budget
    and at equal hot bytes), each its own `main` process with its own limit, each figure saved as it comes."""
    from benchmarks.gpu_pi import parse_tps, pi_env, pi_plan

    anchors = Path(args.anchors)
    binary = anchors / "powerinfer-cuda" / "bin" / "main"
    if not binary.exists():
        b.note(
            "skipped",
            "powerinfer",
            f"{binary} missing (bash benchmarks/gpu_run.sh --prepare, carry .anchors)",
        )
        return
    if args.device != "cuda":
        b.note("skipped", "powerinfer", "no CUDA GPU (its binaries are CUDA builds)")
        return
    start = time.monotonic()
    pi_out = Path(args.workdir) / "pi"
    pi_out.mkdir(parents=True, exist_ok=True)
    env, problem = pi_env(anchors, pi_out)
    if problem:
        b.note("errors", "powerinfer", problem)
        return
    r = b.results
    runs = pi_plan(sparse, dense, budget_gib=r["budget_gib"], equal_bytes_gib=r.get("pi_equal_bytes_budget_gib"),
                   ngl=r["ngl"], n_gen=args.n_gen, threads=args.threads, ctx=args.ctx)  # fmt: skip
    table: dict = {}
    logs: dict = {}
    try:
        for run in runs:
            left = limit_s - (time.monotonic() - start)
            if left < 10:
                b.note(
                    "skipped",
                    f"powerinfer_{run.name}",
                    f"{left:.0f} s left of the original's {limit_s:.0f} s",
                )
                continue
            if run.reset_index:  # a placement solved for another budget is reused silently (reference §3.1)
                Path(run.reset_index + ".generated.gpuidx").unlink(missing_ok=True)
            lines: list[str] = []
            rc, _ = b.run_proc([str(binary), *run.argv], limit_s=min(args.pi_run_limit_s, left), env=env,
                               on_line=lines.append, cwd=pi_out)  # fmt: skip
            text = "".join(lines)
            (pi_out / f"pi-{run.name}.log").write_text(text)
            logs[run.name] = text[-1500:]
            tps = parse_tps(text)
            table[run.name] = {"rc": rc, "tps": tps, "argv": " ".join(run.argv)}
            b.set(
                pi_table=dict(table),
                powerinfer={"binary": str(binary), "logs": dict(logs)},
                **{run.field: tps},
            )
            if tps is None or rc != 0:
                b.note("errors", f"powerinfer_{run.name}", f"rc={rc}, no tokens/s (see powerinfer.logs)")
    finally:
        Path(str(sparse) + ".generated.gpuidx").unlink(missing_ok=True)


def gpu_tests(b: Bench, limit_s: float) -> None:
    files = sorted(
        str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py") if "mark.gpu" in p.read_text()
    )
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-m",
        "gpu",
        "--continue-on-collection-errors",
        "-p",
        "no:cacheprovider",
    ]
    rc, tail = b.run_proc(cmd + (files or ["tests/"]), limit_s=limit_s)
    b.set(gpu_tests={"files": files, "returncode": rc, "tail": tail[-2500:]})
