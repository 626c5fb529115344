"""Chat prompts: the model's own `tokenizer.chat_template` (jinja2, as transformers renders it), else a
plain built-in template."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from hotcold.tokenizer import Tokenizer

# Used when a model has no template: simple role-prefixed turns ending with the assistant's cue.
FALLBACK_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n\n"
    "{% elif message['role'] == 'user' %}User: {{ message['content'] }}\n"
    "{% else %}Assistant: {{ message['content'] }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)

ROLES = ("system", "user", "assistant")


def validate_messages(messages: Sequence[dict]) -> None:
    if not messages:
        raise ValueError("messages must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content'")
        if m["role"] not in ROLES:
            raise ValueError(f"messages[{i}].role {m['role']!r} is not one of {ROLES}")
        if not isinstance(m["content"], str):
            raise ValueError(f"messages[{i}].content must be a string")


def render_chat(tokenizer: Tokenizer, messages: Sequence[dict], *, add_generation_prompt: bool = True) -> str:
    validate_messages(messages)
    template = tokenizer.chat_template or FALLBACK_TEMPLATE
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message):
        raise ValueError(f"chat template: {message}")

    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)  # used by many HF templates
    try:
        compiled = env.from_string(template)
    except jinja2.TemplateError as exc:
        raise ValueError(f"the model's chat template does not parse: {exc}") from exc
    # the token texts ("<s>"): encode() turns them back into the special tokens
    bos = tokenizer.piece(tokenizer.bos_id) if tokenizer.bos_id is not None else ""
    eos = tokenizer.piece(tokenizer.eos_id) if tokenizer.eos_id is not None else ""
    try:
        return compiled.render(
            messages=[{"role": m["role"], "content": m["content"]} for m in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=bos,
            eos_token=eos,
        )
    except (jinja2.TemplateError, TypeError) as exc:
        raise ValueError(f"the model's chat template failed: {exc}") from exc
