"""validate: the shared rules for numbers and text that people give us (CLI, API, server)."""

from __future__ import annotations

import pytest

from hotcold import validate
from hotcold.validate import check, read_text_file, threads_warning


@pytest.mark.parametrize(
    "field, value",
    [
        ("repeat_penalty", float("nan")),
        ("repeat_penalty", 0.0),
        ("repeat_penalty", float("inf")),
        ("temperature", float("nan")),
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", float("nan")),
        ("min_p", 1.5),
        ("seed", 2**64),
        ("seed", 2**70),
        ("seed", -1),
        ("seed", 1.5),
        ("seed", True),
        ("seed", "3"),
        ("vram_budget", float("inf")),
        ("vram_budget", 1e12),
        ("vram_budget", -1.0),
        ("vram_budget", 10**400),
        ("threads", 0),
        ("ctx_size", -1),
        ("top_k", -1),
    ],
)
def test_refused_with_the_rule(field, value):
    with pytest.raises(
        ValueError, match=rf"--x must be .*, got {value!r}".replace("(", r"\(").replace(")", r"\)")
    ):
        check(field, value, label="--x")


def test_accepted_values_come_back_typed():
    assert check("seed", 0) == 0 and check("seed", 2**64 - 1) == 2**64 - 1
    assert check("seed", 7.0) == 7 and isinstance(check("seed", 7.0), int)  # JSON numbers
    assert check("temperature", 0) == 0.0 and isinstance(check("temperature", 1), float)
    assert check("vram_budget", 24) == 24.0
    assert check("top_p", 1.0) == 1.0 and check("min_p", 0.0) == 0.0
    assert validate.check_optional("seed", None) is None


def test_messages_say_the_range():
    with pytest.raises(ValueError, match=r"--seed must be in \[0, 2\*\*64\), got 18446744073709551616"):
        check("seed", 2**64, label="--seed")
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*64\), got 1.5"):
        check("seed", 1.5)
    with pytest.raises(ValueError, match="--repeat-penalty must be a finite number > 0, got nan"):
        check("repeat_penalty", float("nan"), label="--repeat-penalty")


def test_threads_warning(monkeypatch):
    monkeypatch.setattr(validate, "available_cores", lambda: 2)
    assert threads_warning(2) is None
    assert "-t 1000 is more than the 2 CPU core(s)" in threads_warning(1000, "-t")


def test_text_with_a_lone_surrogate():
    assert validate.check_text("prompt", "caf\u00e9") == "caf\u00e9"
    with pytest.raises(ValueError, match="prompt: character 0 is a lone UTF-16 surrogate"):
        validate.check_text("prompt", "\ud800abc")


def test_read_text_file(tmp_path):
    good = tmp_path / "a.txt"
    good.write_text("h\u00e9llo", encoding="utf-8")
    assert read_text_file(good) == "h\u00e9llo"
    bad = tmp_path / "b.txt"
    bad.write_bytes(b"hello \xe9t\xe9")  # Latin-1
    with pytest.raises(ValueError, match=r"b.txt: not UTF-8 text \(invalid continuation byte at byte 6"):
        read_text_file(bad)
    with pytest.raises(ValueError, match="no such file"):
        read_text_file(tmp_path / "none.txt")
    with pytest.raises(ValueError, match="is a folder"):
        read_text_file(tmp_path)
