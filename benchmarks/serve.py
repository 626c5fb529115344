"""Aggregate generation throughput of `hotcold serve` with 1, 4 and 8 concurrent streaming clients.

Starts the real server (`hotcold serve` as its own process, 127.0.0.1, a free port, --parallel = the most
clients; --in-process: uvicorn in a thread of this process, sharing the clients' interpreter), sends every
client a different prompt at the same moment (`/v1/completions`, stream, temperature 0,
`ignore_eos` so each produces exactly --max-tokens tokens), and reports total tokens / wall time, mean time
to first token and per-client tokens/s. The single-request figure without HTTP (`llm.generate`) is
measured alongside, so the server's overhead shows as a ratio. Prints JSON and appends a dated section to
benchmarks/RESULTS_LOG.md.

    python benchmarks/serve.py [MODEL] [--clients 1,4,8] [--max-tokens 32] [-t THREADS] [--modes sparse,dense]
        [--llama-server BIN --anchor-model DENSE.gguf] [--ray --replicas 2]

The server batches: every running request's next token goes in one forward (continuous batching), so the
aggregate grows with the clients while the weights are read once per step. With --llama-server, upstream
llama.cpp's server (continuous batching, -np = the most clients, same threads) runs the same loads on the
same weights in the dense layout (`benchmarks/synth.py --dense` with the same seed), in the same run.
With --ray (issue #17), the same loads also go to N Ray Serve replicas of each mode on a local Ray cluster
(`hotcold serve --ray`'s deployment, each replica with threads / N threads and --parallel slots, behind
Ray's proxy): aggregate throughput against the one plain server, plus what the cluster costs to start.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import torch

import hotcold
from hotcold.loader import demo_model_path
from hotcold.server.app import create_app


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


class Server:
    """uvicorn in a thread, on 127.0.0.1 at a free port."""

    def __init__(self, app):
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self.url

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


# Every load sends prompts the server has never seen: a server with a prefix cache (both hotcold and
# llama-server reuse a slot's cached tokens) would otherwise serve a repeated prompt without prefilling it,
# and the runs would not be comparable (a 1-client run after the warm-up's identical prompt measured
# decode alone, while the 8-client run prefilled seven new prompts).
_LOAD = itertools.count(1)


# --prompts: "template" prompts of one load share their first words ("Load 3, client "), as requests built from
# one template do, and a server sharing cached starts across slots prefills that part once; "distinct" prompts
# start with a word of their client's own (the same length), so a load's clients share nothing but the BOS.
_PROMPT_STYLE = {"style": "template"}
_FIRST_WORDS = [
    "Apex",
    "Bolt",
    "Cove",
    "Dune",
    "Echo",
    "Fern",
    "Glen",
    "Hush",
    "Iris",
    "Jade",
    "Kelp",
    "Lynx",
]


_PROMPTS_SAY = {
    "template": "`--prompts template`: a load's prompts share their first words, as requests built from one template do",
    "distinct": "`--prompts distinct`: a load's prompts share nothing but the BOS",
}


def fresh_prompt(client: int, load: int) -> str:
    if _PROMPT_STYLE["style"] == "distinct":
        return f"{_FIRST_WORDS[client % len(_FIRST_WORDS)]} {load}, client {client}: once upon a time"
    return f"Load {load}, client {client}: once upon a time"


def one_client(url: str, prompt: str, max_tokens: int, start: threading.Barrier, out: dict) -> None:
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    # The HTTP client is built before the clock starts: building one takes ~16 ms (its SSL context), and eight
    # client threads built theirs one after another under the GIL, so an 8-client load's requests reached the
    # server over ~130 ms of client-side work that was counted as the servers' time.
    with httpx.Client(timeout=600) as client:
        start.wait()
        t0 = time.perf_counter()
        first = None
        tokens = chunks = prompt_tokens = 0
        cached = None  # prompt tokens the server took from a cache, where it says (OpenAI's usage field)
        with client.stream("POST", url + "/v1/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if obj.get("choices") and obj["choices"][0].get("text"):
                    first = first or time.perf_counter()
                    chunks += 1
                if obj.get("usage"):
                    tokens = obj["usage"]["completion_tokens"]
                    prompt_tokens = obj["usage"].get("prompt_tokens", 0)
                    cached = (obj["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
        end = time.perf_counter()
    out.update(
        start=t0,
        first=first or end,
        end=end,
        tokens=tokens or chunks,
        prompt_tokens=prompt_tokens,
        cached=cached,
    )


def run_clients(url: str, n: int, max_tokens: int) -> dict:
    start = threading.Barrier(n)
    results = [{} for _ in range(n)]
    load = next(_LOAD)
    threads = [
        threading.Thread(target=one_client, args=(url, fresh_prompt(i, load), max_tokens, start, results[i]))
        for i in range(n)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if any("tokens" not in r for r in results):
        raise RuntimeError("a client failed (see the traceback above)")
    wall = max(r["end"] for r in results) - min(r["start"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    return {
        "clients": n,
        "tokens": tokens,
        "prompt_tokens": sum(r["prompt_tokens"] for r in results),
        # prompt tokens the server took from a cache instead of computing them (None: it does not say)
        "prompt_tokens_cached": None
        if any(r["cached"] is None for r in results)
        else sum(r["cached"] for r in results),
        "wall_s": round(wall, 3),
        "aggregate_tokens_per_s": round(tokens / wall, 2),
        "per_client_tokens_per_s_mean": round(
            sum(r["tokens"] / (r["end"] - r["start"]) for r in results) / n, 2
        ),
        "ttft_s_mean": round(sum(r["first"] - r["start"] for r in results) / n, 3),
        "ttft_s_max": round(max(r["first"] - r["start"] for r in results), 3),
    }


def median_of(loads: list[dict]) -> dict:
    """The load with the median aggregate rate, with every load's rate beside it."""
    runs = sorted(loads, key=lambda r: r["aggregate_tokens_per_s"])
    median = dict(runs[(len(runs) - 1) // 2])
    if len(runs) > 1:
        median["rounds_aggregate_tokens_per_s"] = [r["aggregate_tokens_per_s"] for r in runs]
    return median


def interleaved_loads(url: str, clients: list[int], max_tokens: int, rounds: int, name: str) -> list[dict]:
    """`rounds` loads of each client count (fresh prompts each time), taken in turns (1, 8, 1, 8, ...), each
    count's median load reported. In turns, the host's drift (a shared 2-core host moves 30-40% within minutes)
    falls on every count alike; all loads of one count and then all of the next let the 1-client loads meet a
    fast stretch and the 8-client loads a slow one (the 8 / 1 ratio moved 2.63-3.53x over six runs so). With
    several counts, the largest's entry also lists each turn's ratio of its aggregate to the smallest's."""
    loads: dict[int, list[dict]] = {n: [] for n in clients}
    for turn in range(rounds):
        for n in clients:
            loads[n].append(run_clients(url, n, max_tokens))
        print(f"# {name}: turn {turn + 1} of {rounds} done", file=sys.stderr, flush=True)
    runs = [median_of(loads[n]) for n in clients]
    fewest, most = min(clients), max(clients)
    if fewest != most:
        ratios = [
            round(b["aggregate_tokens_per_s"] / a["aggregate_tokens_per_s"], 2)
            for a, b in zip(loads[fewest], loads[most])
        ]
        runs[clients.index(most)]["rounds_ratio_to_fewest"] = {"clients": fewest, "ratios": ratios}
    return runs


def late_arrival(url: str, busy: int, max_tokens: int) -> dict:
    """Time to first token of one request that arrives while `busy` others are decoding (they run 4x as
    long), against the same request alone: the issue's "under 2x its time alone"."""
    alone: dict = {}  # its own prompt, not the late one's: a server's prefix cache would serve that
    one_client(url, fresh_prompt(0, next(_LOAD)), max_tokens, threading.Barrier(1), alone)
    start = threading.Barrier(busy)
    results = [{} for _ in range(busy)]
    load = next(_LOAD)
    threads = [
        threading.Thread(target=one_client, args=(url, fresh_prompt(i, load), 4 * max_tokens, start, r))
        for i, r in enumerate(results)
    ]
    for t in threads:
        t.start()
    time.sleep(0.5)
    while not any("first" in r for r in results):  # not yet all decoding: wait for the first tokens
        time.sleep(0.05)
        if not any(t.is_alive() for t in threads):
            break
    time.sleep(1.0)  # every busy client past its prefill
    late: dict = {}
    one_client(url, fresh_prompt(busy, next(_LOAD)), max_tokens, threading.Barrier(1), late)
    for t in threads:
        t.join()
    ttft_alone, ttft_late = alone["first"] - alone["start"], late["first"] - late["start"]
    return {
        "busy": busy,
        "ttft_alone_s": round(ttft_alone, 3),
        "ttft_late_s": round(ttft_late, 3),
        "ratio": round(ttft_late / ttft_alone, 2),
    }


def results_section(res: dict, cmd: str, label: str) -> str:
    m = res["machine"]
    lines = [
        "",
        f"## Server throughput, continuous batching (issue #14{', Ray Serve: #17' if res.get('ray') else ''})"
        f" — {res['date'][:16]}",
        "",
        f"Command: `{cmd}`",
        f"Model: {label}",
        f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']} ({m['torch_threads']} threads); "
        f"load average before {m['loadavg_before']}, after {m['loadavg_after']}.",
        f"Each client streams {res['max_tokens']} tokens (temperature 0, ignore_eos) from its own prompt, new to"
        f" the server as a whole ({_PROMPTS_SAY[res.get('prompts', 'template')]}; the server's own count of prompt"
        f" tokens it took from a cache is in brackets where it reports one); --parallel {res['parallel']}."
        + (
            f" Each row is the median of {res['rounds']} loads (every load's aggregate in brackets)."
            if res.get("rounds", 1) > 1
            else ""
        ),
        "",
        "| server | clients | prompt tokens | aggregate tokens/s | per-client tokens/s | mean / max time to first"
        " token | wall |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, runs in res["servers"].items():
        for r in runs:
            lines.append(
                f"| {name} | {r['clients']} | {r.get('prompt_tokens', '?')}"
                f"{'' if r.get('prompt_tokens_cached') is None else ' (' + str(r['prompt_tokens_cached']) + ' cached)'}"
                f" | {r['aggregate_tokens_per_s']}"
                f"{' ' + str(r['rounds_aggregate_tokens_per_s']) if 'rounds_aggregate_tokens_per_s' in r else ''} "
                f"| {r['per_client_tokens_per_s_mean']} "
                f"| {r['ttft_s_mean']} s / {r['ttft_s_max']} s | {r['wall_s']} s |"
            )
    if res.get("ray"):
        ray_rows = [r for name, runs in res["servers"].items() if "Ray" in name for r in runs]
        lines.append(
            f"\nRay Serve: {res['ray']['replicas']} replicas of {ray_rows[0]['threads_per_replica']} thread(s)"
            f" each, --parallel {res['parallel']} each, behind Ray's proxy; the local cluster took"
            f" {ray_rows[0]['cluster_start_s']} s to start with its replicas loaded."
        )
    for name, runs in res["servers"].items():
        turns = next((r["rounds_ratio_to_fewest"] for r in runs if "rounds_ratio_to_fewest" in r), None)
        if turns:
            most = max(r["clients"] for r in runs)
            lines.append(
                f"\n{name}: {most} clients' aggregate over {turns['clients']} client's, load by load (the loads ran in"
                f" turns): {', '.join(f'{x}x' for x in turns['ratios'])}."
            )
    for name, runs in res["servers"].items():
        late = runs[-1].get("late_arrival") if runs else None
        if late:
            lines.append(
                f"\n{name}: a request arriving while {late['busy']} others decode gets its first token in"
                f" {late['ttft_late_s']} s, against {late['ttft_alone_s']} s alone ({late['ratio']}x)."
            )
    for name, tps in res["direct_tokens_per_s"].items():
        lines.append(f"\nSingle request without HTTP, {name} (`llm.generate`, best of 3): {tps} tokens/s.")
    return "\n".join(lines) + "\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_runs(
    cmd: list[str], port: int, name: str, *, clients, max_tokens: int, rounds: int = 1, late: bool = True
) -> list[dict]:
    """The loads against a server run as its own process (`cmd`, listening on `port`): ready when /health
    says 200, then a warm-up request, then each client count; the process is stopped after."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"{name} did not start: {shlex.join(cmd)}")
            time.sleep(0.5)
        run_clients(url, 1, 4)  # warm up
        runs = interleaved_loads(url, clients, max_tokens, rounds, name)
        if late and max(clients) > 1:
            runs[-1]["late_arrival"] = late_arrival(url, max(clients) - 1, max_tokens)
        return runs
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def llama_server_runs(
    binary: str, model: str, *, parallel: int, threads: int, clients, max_tokens: int, rounds: int = 1
):
    """The same loads against upstream llama-server (continuous batching, -np parallel)."""
    port = free_port()
    cmd = [binary, "-m", model, "-np", str(parallel), "-t", str(threads), "-tb", str(threads)]
    cmd += ["-c", str(parallel * 256), "--port", str(port), "--host", "127.0.0.1"]
    return process_runs(cmd, port, "llama-server", clients=clients, max_tokens=max_tokens, rounds=rounds)


def hotcold_server_runs(
    model: Path, mode: str, *, parallel: int, threads, device, clients, max_tokens: int, rounds: int = 1
):
    """The same loads against `hotcold serve` in its own process, as users run it (and as llama-server
    runs): the clients' Python threads do not share its interpreter."""
    port = free_port()
    cmd = [sys.executable, "-m", "hotcold", "serve", "-m", str(model), "-np", str(parallel), "-c", "256"]
    cmd += ["--port", str(port), "--device", device] + (["-t", str(threads)] if threads else [])
    cmd += ["--dense"] if mode == "dense" else []
    return process_runs(cmd, port, label(mode), clients=clients, max_tokens=max_tokens, rounds=rounds)


def label(mode: str) -> str:
    return "hotcold dense, llama-server's file" if mode == "anchor" else f"hotcold {mode}"


def ray_runs(path: Path, mode: str, *, replicas: int, threads: int, parallel: int, clients, max_tokens: int):
    """The same loads against `replicas` Ray Serve replicas (threads split between them)."""
    from hotcold.server.ray_serve import ReplicaConfig, deployment, serving

    per_replica = max(1, threads // replicas)
    config = ReplicaConfig(
        model=str(path), threads=per_replica, parallel=parallel, dense=mode == "dense", device="cpu"
    )
    t0 = time.perf_counter()
    with serving(lambda _: deployment(config, replicas=replicas), port=free_port(), num_cpus=threads) as (
        url,
        _,
    ):
        started = time.perf_counter() - t0
        run_clients(url, replicas, 4)  # warm up the HTTP path and every replica (likely)
        runs = [run_clients(url, n, max_tokens) for n in clients]
    for r in runs:
        r["cluster_start_s"] = round(started, 1)
        r["threads_per_replica"] = per_replica
    print(
        f"# Ray Serve x{replicas} {mode}: started in {started:.1f} s, runs done", file=sys.stderr, flush=True
    )
    return runs


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None, help="model file (default: the bundled demo model)")
    ap.add_argument("--clients", default="1,4,8", help="comma-separated client counts (default 1,4,8)")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens each client generates")
    ap.add_argument("--parallel", type=int, default=None, help="server slots (default: the most clients)")
    ap.add_argument("-t", "--threads", type=int, default=None, help="torch / kernel threads")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument(
        "--modes",
        default="sparse",
        help="hotcold modes to run, in order: sparse,dense,anchor (anchor: hotcold on --anchor-model, the "
        "dense-layout file llama-server serves, so both read the same file)",
    )
    ap.add_argument("--llama-server", default=None, help="upstream llama-server binary to run the same loads")
    ap.add_argument(
        "--anchor-model", default=None, help="the same weights in the dense layout, for llama-server"
    )
    ap.add_argument(
        "--ray", action="store_true", help="also N Ray Serve replicas (pip install 'hotcold[ray]')"
    )
    ap.add_argument("--replicas", type=int, default=2, help="Ray Serve replicas with --ray (threads split)")
    ap.add_argument(
        "--in-process",
        action="store_true",
        help="run hotcold's server in this process (uvicorn in a thread) instead of `hotcold serve`",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="loads per client count, the counts in turns; the median one is reported (default 1)",
    )
    ap.add_argument(
        "--prompts",
        choices=["template", "distinct"],
        default="template",
        help="template: a load's prompts share their first words (default); distinct: they share nothing",
    )
    ap.add_argument("--label", default=None, help="how to name the model in RESULTS_LOG.md")
    ap.add_argument("--no-results", action="store_true", help="do not append to benchmarks/RESULTS_LOG.md")
    args = ap.parse_args(argv)
    _PROMPT_STYLE["style"] = args.prompts
    path = Path(args.model) if args.model else demo_model_path()
    if not path.exists():
        sys.exit(f"serve.py: {path} does not exist (no bundled demo model yet: pass a model path)")
    clients = [int(c) for c in args.clients.split(",")]
    parallel = args.parallel or max(clients)

    loadavg_before = [round(v, 2) for v in os.getloadavg()]
    res: dict = {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "model": str(path),
        "machine": {
            "cpu": cpu_name(),
            "cores": os.cpu_count(),
            "torch": torch.__version__.split("+")[0],
            "loadavg_before": loadavg_before,
        },
        "max_tokens": args.max_tokens,
        "parallel": parallel,
        "rounds": args.rounds,
        "prompts": args.prompts,
        "direct_tokens_per_s": {},
        "ray": {"replicas": args.replicas} if args.ray else None,
        "servers": {},
    }
    prompt = "Client 0: once upon a time"
    for mode in args.modes.split(","):
        if mode not in ("sparse", "dense", "anchor"):
            ap.error(f"--modes: unknown mode {mode!r} (sparse, dense or anchor)")
        if mode == "anchor" and not args.anchor_model:
            ap.error("--modes anchor needs --anchor-model")
        model = Path(args.anchor_model).resolve() if mode == "anchor" else path
        llm = hotcold.load(model, threads=args.threads, device=args.device, dense=mode == "dense")
        res["machine"]["torch_threads"] = torch.get_num_threads()
        llm.generate(prompt, max_tokens=4, ignore_eos=True)  # warm up kernels
        direct = [0.0]

        def direct_run(llm=llm, direct=direct) -> None:
            for _ in range(3):  # best of 3: the machine may be shared
                t0 = time.perf_counter()
                llm.generate(prompt, max_tokens=args.max_tokens, ignore_eos=True)
                direct[0] = max(direct[0], args.max_tokens / (time.perf_counter() - t0))

        # in a worker thread, as the server's batch thread runs
        worker = threading.Thread(target=direct_run)
        worker.start()
        worker.join()
        res["direct_tokens_per_s"][label(mode)] = round(direct[0], 2)
        if args.in_process:  # the model just measured serves
            with Server(create_app(llm, parallel=parallel)) as url:
                run_clients(url, 1, 4)  # warm up the HTTP path
                runs = interleaved_loads(url, clients, args.max_tokens, args.rounds, label(mode))
        else:
            del llm  # `hotcold serve` loads its own
            runs = hotcold_server_runs(
                model,
                mode,
                parallel=parallel,
                threads=args.threads,
                device=args.device,
                clients=clients,
                max_tokens=args.max_tokens,
                rounds=args.rounds,
            )
        res["servers"][label(mode)] = runs
        if args.ray:
            res["servers"][f"{label(mode)}, Ray Serve x{args.replicas}"] = ray_runs(
                model,
                mode,
                replicas=args.replicas,
                threads=args.threads or torch.get_num_threads(),
                parallel=parallel,
                clients=clients,
                max_tokens=args.max_tokens,
            )
    if args.llama_server:
        threads = args.threads or torch.get_num_threads()
        res["servers"]["llama-server (dense)"] = llama_server_runs(
            args.llama_server,
            args.anchor_model,
            parallel=parallel,
            threads=threads,
            clients=clients,
            max_tokens=args.max_tokens,
            rounds=args.rounds,
        )
    res["machine"]["loadavg_after"] = [round(v, 2) for v in os.getloadavg()]
    print(json.dumps(res, indent=1))
    if not args.no_results:
        out = Path(__file__).with_name("RESULTS_LOG.md")
        if not out.exists():
            out.write_text(
                "# Benchmark results\n\nEvery figure we quote, with the command that produced it.\n"
            )
        cmd = shlex.join(["python", "benchmarks/serve.py", *(argv if argv is not None else sys.argv[1:])])
        with out.open("a") as f:
            f.write(results_section(res, cmd.strip(), args.label or path.name))
    return res


if __name__ == "__main__":
    main()
