"""Benchmark: ferry's registry service beside Debian's docker-registry, in one run.

Starts both on loopback over fresh temp directories (filesystem storage), drives each with
`../shared/bench/regbench.py` (same arguments, same seed), and prints every figure side by side
with the ratio ferry/reference (throughput: higher is better for ferry). Each phase runs against
the reference, then ferry, before the next group of phases starts. A third server, ferry with
`--auth` (the same phases through a Bearer token that regbench fetches once and reuses, as
real clients do; rate limits set out of reach so only their bookkeeping is measured), runs
beside them; `--no-auth-run` skips it. Run by hand:

    .venv/bin/python bench/registry.py                 # the full run (minutes)
    .venv/bin/python bench/registry.py --big-mib 128   # quicker; other regbench flags pass through
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("FERRY_SHARED_DIR", REPO.parent / "shared"))
REGBENCH = SHARED / "bench" / "regbench.py"
DOCKER_REGISTRY = "/usr/bin/docker-registry"
REFERENCE_CONFIG = """version: 0.1
log:
  level: error
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: {root}
  delete:
    enabled: true
http:
  addr: 127.0.0.1:{port}
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url}: the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/v2/", timeout=2) as r:
                if r.status == 200:
                    return
        except urllib.error.HTTPError as err:
            if err.code == 401:  # an authenticated registry's challenge: it is up
                return
            time.sleep(0.1)
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"{url}: not ready after {timeout}s")


def start_ferry(root: Path, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "ferry.cli", "registry", "serve", "--host", "127.0.0.1",
           "--port", str(port), "--root", str(root)]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL)


AUTH_USER = ("bench", "bench-pw")
AUTH_RULES = """
[access."regbench/*"]
bench = ["pull", "push", "delete"]
"""


def start_ferry_auth(root: Path, port: int) -> subprocess.Popen:
    """ferry with an auth file (one user, push/pull/delete on regbench/*), limits out of reach."""
    sys.path.insert(0, str(REPO))
    from registry.service.auth.userfile import add_user

    auth = root.parent / "auth" / "auth.toml"
    add_user(auth, AUTH_USER[0], AUTH_USER[1], [], [])
    auth.write_text(auth.read_text() + AUTH_RULES)
    cmd = [sys.executable, "-m", "ferry.cli", "registry", "serve", "--host", "127.0.0.1",
           "--port", str(port), "--root", str(root), "--auth", str(auth),
           "--rate-limit", "1000000", "--max-uploads", "100000",
           "--audit-log", str(root.parent / "audit.log")]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL)


def start_reference(root: Path, port: int) -> subprocess.Popen:
    config = root.parent / "reference.yml"
    config.write_text(REFERENCE_CONFIG.format(root=root, port=port))
    return subprocess.Popen([DOCKER_REGISTRY, "serve", str(config)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def run_regbench(url: str, pid: int, out: Path, extra: list[str], seed: int) -> dict:
    cmd = [sys.executable, str(REGBENCH), "--url", url, "--server-pid", str(pid),
           "--json", str(out), "--seed", str(seed), "--cleanup", *extra]
    print(f"$ {' '.join(cmd)}", file=sys.stderr, flush=True)
    done = subprocess.run(cmd)
    if done.returncode != 0:
        raise SystemExit(f"regbench against {url} failed with {done.returncode}")
    return json.loads(out.read_text())


def _ratio(mine: float | None, theirs: float | None) -> str:
    return f"{mine / theirs:6.2f}x" if mine and theirs else "      -"


def print_side_by_side(ferry: dict, reference: dict, auth: dict | None = None) -> None:
    ref_rows = {row["name"]: row for row in reference["summary"]}
    auth_rows = {row["name"]: row for row in (auth or {"summary": []})["summary"]}
    header = f"{'phase':34} {'ferry':>10} {'reference':>10} {'unit':>6} {'ratio':>7}"
    if auth is not None:
        header += f" {'ferry+auth':>10} {'auth/open':>9} {'auth/ref':>8}"
    print(header)
    print("-" * len(header))
    for row in ferry["summary"]:
        ref = ref_rows.get(row["name"], {})
        bulk = row["mib_s"] is not None and not row["name"].startswith("small")
        unit = "MiB/s" if bulk else "ops/s"
        key = "mib_s" if unit == "MiB/s" else "ops_s"
        mine, theirs = row.get(key), ref.get(key)
        line = f"{row['name']:34} {mine or 0:10.1f} {theirs or 0:10.1f} {unit:>6} "
        line += _ratio(mine, theirs)
        if auth is not None:
            authed = auth_rows.get(row["name"], {}).get(key)
            line += f" {authed or 0:10.1f} {_ratio(authed, mine):>9} {_ratio(authed, theirs):>8}"
        print(line)


# Phases that feed each other run in one regbench call: pull reads the blob big pushed, head
# probes the blobs small pushed (as regbench intends), so no untimed re-push sits between them.
GROUPS = ("big,pull", "manifest", "small,head")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="Unknown flags are passed to regbench.py.")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--groups", default=";".join(GROUPS),
                        help="';'-separated regbench phase groups, each run against both "
                        "registries in turn (default: %(default)s)")
    parser.add_argument("--keep", action="store_true", help="keep the temp directories")
    parser.add_argument("--no-auth-run", action="store_true",
                        help="skip the authenticated ferry (token flow) run")
    args, extra = parser.parse_known_args(argv)
    if not Path(DOCKER_REGISTRY).exists():
        raise SystemExit(f"{DOCKER_REGISTRY} is missing: apt-get install docker-registry")
    work = Path(tempfile.mkdtemp(prefix="ferry-bench-"))
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    try:
        starts = [("reference", start_reference), ("ferry", start_ferry)]
        if not args.no_auth_run:
            starts.append(("ferry+auth", start_ferry_auth))
        for label, start in starts:
            root = work / label / "root"
            root.mkdir(parents=True)
            port = free_port()
            proc = start(root, port)
            servers[label] = (proc, f"http://127.0.0.1:{port}")
            wait_ready(servers[label][1], proc)
        # Group by group, alternating, so a burst of load on this shared machine hits both
        # registries alike instead of whichever happened to run during it.
        results: dict[str, dict] = {label: {"summary": []} for label in servers}
        for number, group in enumerate(args.groups.split(";")):
            for label, (proc, url) in servers.items():
                out = work / f"{label.replace('+', '-')}-{number}.json"
                creds = ["--user", ":".join(AUTH_USER)] if label == "ferry+auth" else []
                got = run_regbench(url, proc.pid, out, ["--phases", group, *creds, *extra],
                                   args.seed)
                results[label]["summary"] += got["summary"]
        print()
        print_side_by_side(results["ferry"], results["reference"], results.get("ferry+auth"))
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
