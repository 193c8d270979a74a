"""`ferry serve` as its own process, its runners the stand-in fake_runner.py (no MLX), for the
test that kills the server with SIGKILL and expects its runners to go too.

    python serve_with_fake_runners.py PORT    (FERRY_HOME from the environment)
"""

from __future__ import annotations

import sys

import uvicorn
from runner_fakes import fake_command

from ferry.app import build_model_server
from ferry.config import Settings


def main() -> None:
    app = build_model_server(Settings.from_env())
    app.state.scheduler.command = fake_command()
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")


if __name__ == "__main__":
    main()
