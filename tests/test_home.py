"""FERRY_HOME is created 0700 even under umask 000 (it holds credentials and the key)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ferry.cli import main


def test_ferry_home_is_created_private_under_a_zero_umask(tmp_path: Path, monkeypatch) -> None:
    home = tmp_path / "parent" / "home"
    monkeypatch.setenv("FERRY_HOME", str(home))
    old = os.umask(0)
    try:
        assert main(["registry", "gc", "--dry-run", "--root", str(tmp_path / "reg")]) == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE(home.stat().st_mode) == 0o700


def test_an_existing_home_keeps_its_mode(tmp_path: Path, monkeypatch) -> None:
    home = tmp_path / "home"
    home.mkdir(mode=0o750)
    home.chmod(0o750)
    monkeypatch.setenv("FERRY_HOME", str(home))
    assert main(["registry", "gc", "--dry-run", "--root", str(tmp_path / "reg")]) == 0
    assert stat.S_IMODE(home.stat().st_mode) == 0o750
