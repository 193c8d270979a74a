"""FERRY_HOME holds credentials, the signing key and the models: only its owner may enter it.

Created 0700 whatever the umask (under umask 000 a plain mkdir made it 0777); an existing
directory is left as its owner set it.
"""

from __future__ import annotations

import os
from pathlib import Path


def make_home(home: Path) -> None:
    if home.is_dir():
        return
    home.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(home, 0o700)
    except FileExistsError:
        return  # made meanwhile by another ferry process
    os.chmod(home, 0o700)  # mkdir's mode passes through the umask; this does not
