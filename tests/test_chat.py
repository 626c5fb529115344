"""Chat templates: the model's own (jinja2, as transformers renders them) or the built-in fallback."""

from __future__ import annotations

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
