"""Fixtures for the release tests: S3 credentials in the environment, a recording sleep."""

from __future__ import annotations

import pytest

from .s3_helpers import CREDENTIALS


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    if CREDENTIALS:  # moto: fixed test credentials, nothing from the developer's profile
        monkeypatch.delenv("AWS_PROFILE", raising=False)
    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)


class SleepRecorder:
    """Stands in for time.sleep: records each requested delay, waits only a moment."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)


@pytest.fixture
def sleeps() -> SleepRecorder:
    return SleepRecorder()
