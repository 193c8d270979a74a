"""One Go-style duration parser for FERRY_KEEP_ALIVE, FERRY_LOAD_TIMEOUT and keep_alive."""

from __future__ import annotations

import pytest

from ferry.config import ConfigError, Settings
from server.api_errors import APIError
from server.chat_request import parse_keep_alive
from server.durations import InvalidDuration, parse_duration

FORMS = [
    ("30s", 30.0), ("1h30m", 5400.0), ("500ms", 0.5), ("1.5s", 1.5), ("2h", 7200.0),
    ("1m30.5s", 90.5), ("+5m", 300.0), ("-1s", -1.0), ("-1m", -60.0),
    ("-1", -1.0), ("0", 0.0), ("0s", 0.0), ("300", 300.0), ("2.5", 2.5), (" 45s ", 45.0),
]
BAD = ["", "5 minutes", "m5", "5x", "1h30", "s", "-", "1h-30m", "inf", "nan", "5d"]


@pytest.mark.parametrize(("text", "seconds"), FORMS)
def test_go_durations_and_bare_numbers_parse_to_seconds(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", BAD)
def test_what_is_not_a_duration_is_refused_with_its_text(text):
    with pytest.raises(InvalidDuration, match="invalid duration") as info:
        parse_duration(text)
    assert info.value.text == text


@pytest.mark.parametrize(("text", "seconds"), FORMS)
def test_the_environment_and_a_request_accept_the_same_durations(text, seconds):
    settings = Settings.from_env({"FERRY_KEEP_ALIVE": text, "FERRY_LOAD_TIMEOUT": text})
    assert settings.keep_alive == pytest.approx(seconds)
    assert settings.load_timeout == pytest.approx(seconds)
    assert parse_keep_alive(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", [t for t in BAD if t.strip()])
def test_a_bad_duration_is_refused_by_both_with_a_clear_error(text):
    with pytest.raises(ConfigError, match=f"FERRY_KEEP_ALIVE must be a duration .*got {text!r}"):
        Settings.from_env({"FERRY_KEEP_ALIVE": text})
    with pytest.raises(APIError, match="invalid keep_alive: invalid duration") as info:
        parse_keep_alive(text)
    assert info.value.status == 400
