"""hotcold run [MODEL]: a chat in the terminal, as `ollama run` and llama.cpp's conversation mode.

The model's own chat template renders the whole history each turn (the engine's prefix cache reuses what
it has already computed, so a turn costs only its new tokens); replies stream as they are generated.
Ctrl-C stops a reply (after the token being computed, so the context stays whole) and the chat goes on; a
second Ctrl-C before that token comes (a long prompt being read) ends the chat;
Ctrl-C at the prompt, Ctrl-D or /bye ends it. When the history no longer fits the context, the oldest turns
are dropped (the system prompt stays), and the chat says so. A chat template that fails (it raises, or runs
past its bounds) is named in a warning and the chat goes on in plain text ("User: ... Assistant:")."""

from __future__ import annotations

import signal
import sys
import threading
import time

from hotcold.chat import ChatTemplateError, render_chat
from hotcold.cli import add_model_args, load_from_args
from hotcold.cli.generate import add_sampling_args, sampling_kwargs

HELP = "/bye: end the chat   /clear: forget the conversation   /help: this list   Ctrl-C: stop a reply"


def add_args(p) -> None:
    add_model_args(p, positional=True)
    p.add_argument(
        "-n", "--n-predict", type=int, default=None, help="most tokens a reply (default: the context left)"
    )
    p.add_argument(
        "-sys", "--system-prompt", default=None, help="a system message that starts the conversation"
    )
    add_sampling_args(p)


def run(args) -> int:
    llm = load_from_args(args)
    for note in llm.loaded.notes:
        print(f"hotcold: {note}", file=sys.stderr)
    name = args.model_name or "the bundled demo model"
    print(f"hotcold: chatting with {name} ({llm.ctx_size}-token context). {HELP}", file=sys.stderr)
    system = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
    history = list(system)
    prompt = Prompt(llm)
    interactive = sys.stdin.isatty()
    while True:
        try:
            line = input(">>> " if interactive else "")
        except EOFError:
            break
        except KeyboardInterrupt:
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/bye", "/exit", "/quit"):
            break
        if text == "/clear":
            history = list(system)
            print("hotcold: conversation cleared", file=sys.stderr)
            continue
        if text.startswith("/"):
            print(f"hotcold: {HELP}", file=sys.stderr)
            continue
        message = {"role": "user", "content": line}
        alone, _ = fit_history(prompt, [*system, message], len(system), args.n_predict)
        if len(alone) == len(system):  # refused before the history is touched: the conversation stays
            print(
                "hotcold: that message alone does not fit the context; say less or use a larger -c",
                file=sys.stderr,
            )
            continue
        history, dropped = fit_history(prompt, [*history, message], len(system), args.n_predict)
        if dropped:
            print(
                f"hotcold: the context is full: the oldest {dropped} message(s) are dropped", file=sys.stderr
            )
        reply = _stream_reply(llm, prompt.ids(history), args)
        history.append({"role": "assistant", "content": reply})
    print(file=sys.stderr)
    return 0


class Prompt:
    """A conversation's prompt ids: the model's chat template, or, once it has failed (named in a warning),
    plain text by the built-in template for the rest of the chat."""

    def __init__(self, llm):
        self.llm = llm
        self.plain = False

    def ids(self, history: list[dict]) -> list[int]:
        if not self.plain:
            try:
                return self.llm.chat_prompt_ids(history)
            except ChatTemplateError as exc:
                print(f"hotcold: warning: {exc}; the chat goes on in plain text", file=sys.stderr)
                self.plain = True
        return self.llm.tokenize(render_chat(self.llm.tokenizer, history, builtin=True))


def fit_history(
    prompt: Prompt, history: list[dict], keep: int, n_predict: int | None
) -> tuple[list[dict], int]:
    """`history` without its oldest messages (after the first `keep`, the system prompt) until the prompt and
    room for a reply fit the context: (history, messages dropped)."""
    room = min(n_predict or 64, prompt.llm.ctx_size // 4)  # a reply needs at least some room to start
    dropped = 0
    while len(history) > keep and len(prompt.ids(history)) + room > prompt.llm.ctx_size:
        history = history[:keep] + history[keep + 1 :]
        dropped += 1
        # a conversation restarts at a user turn: an orphaned assistant reply goes with it
        while len(history) > keep and history[keep]["role"] != "user":
            history = history[:keep] + history[keep + 1 :]
            dropped += 1
    return history, dropped


def _stream_reply(llm, ids: list[int], args) -> str:
    """Stream one reply to the prompt `ids` to stdout; Ctrl-C ends it after the current token. The reply's text."""
    max_tokens = args.n_predict if args.n_predict is not None else llm.ctx_size - len(ids)
    stop = threading.Event()
    main_thread = threading.current_thread() is threading.main_thread()

    def interrupt(*_):
        if stop.is_set():  # a second Ctrl-C (a long prompt still being read): end the chat now, as llama.cpp
            raise KeyboardInterrupt
        stop.set()
        print("\nhotcold: stopping after this token (Ctrl-C again ends the chat)", file=sys.stderr)

    previous = signal.signal(signal.SIGINT, interrupt) if main_thread else None
    parts: list[str] = []
    stats = None
    start = time.perf_counter()
    try:
        stream = llm.stream_chunks(ids, max_tokens=max_tokens, **sampling_kwargs(args))
        try:
            for chunk in stream:
                stats = chunk.stats
                if chunk.text:
                    parts.append(chunk.text)
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
                if stop.is_set():
                    break
        finally:
            stream.close()  # between tokens: the engine's context stays whole for the next turn
    finally:
        if main_thread:
            signal.signal(signal.SIGINT, previous)
    sys.stdout.write("\n")
    sys.stdout.flush()
    if stats is not None:
        seconds = time.perf_counter() - start
        note = " (stopped)" if stop.is_set() else ""
        print(
            f"hotcold: {stats.generated_tokens} tokens in {seconds:.1f} s, {stats.generate_tps:.1f} tokens/s"
            f" | FFN neurons computed {100 * stats.firing_rate:.1f}%{note}",
            file=sys.stderr,
        )
    return "".join(parts)
