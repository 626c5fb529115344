"""Chat templates: the model's own (jinja2, as transformers renders them) or the built-in fallback."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hotcold.chat import render_chat


class FakeTokenizer:
    bos_id, eos_id = 1, 2

    def __init__(self, template=None):
        self.chat_template = template

    def piece(self, token_id):
        return {1: "<s>", 2: "</s>"}[token_id]


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def test_model_template_with_special_tokens_and_strftime():
    template = "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{{ strftime_now('%Y') }}"
    out = render_chat(FakeTokenizer(template), MESSAGES)
    assert out.startswith("<s>[system]Be brief.[user]Hi") and out[-4:].isdigit()


def test_fallback_template_ends_with_assistant_cue():
    out = render_chat(FakeTokenizer(), MESSAGES)
    assert out == "Be brief.\n\nUser: Hi\nAssistant:"


@pytest.mark.parametrize(
    "template, messages, match",
    [
        ("{{ raise_exception('no system role') }}", MESSAGES, "no system role"),
        ("{% for %}", MESSAGES, "does not parse"),
        (None, [{"role": "robot", "content": "x"}], "role"),
        (None, [], "non-empty"),
        ("{{ messages[0].content + 1 }}", MESSAGES, "template failed"),
    ],
)
def test_errors_are_value_errors(template, messages, match):
    with pytest.raises(ValueError, match=match):
        render_chat(FakeTokenizer(template), messages)


def test_loop_controls_and_generation_blocks_render():
    """{% break %} / {% continue %} (Command R, Kimi) and {% generation %} blocks (LFM2, Laguna), as transformers
    renders them: the generation block keeps its body."""
    template = (
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{% if m.role == 'assistant' %}{% generation %}A:{{ m.content }}{% endgeneration %}"
        "{% else %}U:{{ m.content }}{% endif %}{% if loop.index > 3 %}{% break %}{% endif %}{% endfor %}"
    )
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"},
            {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"},
            {"role": "user", "content": "never"}]  # fmt: skip
    assert render_chat(FakeTokenizer(template), msgs) == "U:u1A:a1U:u2"


UPSTREAM_TEMPLATES = (
    Path(os.environ.get("HOTCOLD_LLAMA_CPP", Path.home() / ".cache" / "hotcold-anchors" / "llama.cpp"))
    / "models"
    / "templates"
)
# templates whose own rules refuse this conversation: Gemma 2 has no system role; FireFunction wants `functions`
REFUSING = {"google-gemma-2-2b-it.jinja", "fireworks-ai-llama-3-firefunction-v2.jinja"}


def test_upstream_templates_render_a_conversation():
    """Every chat template upstream llama.cpp keeps (models/templates/*.jinja, from the source the anchors script
    unpacks) renders a system + user + assistant + user conversation with the last message in it, or refuses it
    by its own rule with a ValueError naming it."""
    if not UPSTREAM_TEMPLATES.is_dir():
        pytest.skip(
            f"no {UPSTREAM_TEMPLATES} (../shared/anchors/build-llama-cpp.sh unpacks it; HOTCOLD_LLAMA_CPP)"
        )
    msgs = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "How are you today?"}]  # fmt: skip
    failed = {}
    for path in sorted(UPSTREAM_TEMPLATES.glob("*.jinja")):
        try:
            if "How are you today?" not in render_chat(FakeTokenizer(path.read_text()), msgs):
                failed[path.name] = "the last message is missing"
        except ValueError as exc:
            if path.name not in REFUSING:
                failed[path.name] = str(exc)
    assert len(list(UPSTREAM_TEMPLATES.glob("*.jinja"))) > 50
    assert not failed, failed
