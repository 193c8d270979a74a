"""Benchmark: ferry's registry service beside Debian's docker-registry, in one run.

Starts both on loopback over fresh temp directories (filesystem storage), drives each with
`../shared/bench/regbench.py` (same arguments, same seed), and prints every figure side by side
with the ratio ferry/reference (throughput: higher is better for ferry). Each phase runs against
the reference, then ferry, before the next group of phases starts. Run by hand:

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
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"{url}: not ready after {timeout}s")


def start_ferry(root: Path, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "ferry.cli", "registry", "serve", "--host", "127.0.0.1",
           "--port", str(port), "--root", str(root)]
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


def print_side_by_side(ferry: dict, reference: dict) -> None:
    ref_rows = {row["name"]: row for row in reference["summary"]}
    header = f"{'phase':34} {'ferry':>10} {'reference':>10} {'unit':>6} {'ratio':>7}"
    print(header)
    print("-" * len(header))
    for row in ferry["summary"]:
        ref = ref_rows.get(row["name"], {})
        bulk = row["mib_s"] is not None and not row["name"].startswith("small")
        unit = "MiB/s" if bulk else "ops/s"
        key = "mib_s" if unit == "MiB/s" else "ops_s"
        mine, theirs = row.get(key), ref.get(key)
        ratio = f"{mine / theirs:6.2f}x" if mine and theirs else "      -"
        print(f"{row['name']:34} {mine or 0:10.1f} {theirs or 0:10.1f} {unit:>6} {ratio}")


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
    args, extra = parser.parse_known_args(argv)
    if not Path(DOCKER_REGISTRY).exists():
        raise SystemExit(f"{DOCKER_REGISTRY} is missing: apt-get install docker-registry")
    work = Path(tempfile.mkdtemp(prefix="ferry-bench-"))
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    try:
        for label, start in (("reference", start_reference), ("ferry", start_ferry)):
            root = work / label / "root"
            root.mkdir(parents=True)
            port = free_port()
            proc = start(root, port)
            servers[label] = (proc, f"http://127.0.0.1:{port}")
            wait_ready(servers[label][1], proc)
        # Group by group, alternating, so a burst of load on this shared machine hits both
        # registries alike instead of whichever happened to run during it.
        results: dict[str, dict] = {"reference": {"summary": []}, "ferry": {"summary": []}}
        for number, group in enumerate(args.groups.split(";")):
            for label, (proc, url) in servers.items():
                out = work / f"{label}-{number}.json"
                got = run_regbench(url, proc.pid, out, ["--phases", group, *extra], args.seed)
                results[label]["summary"] += got["summary"]
        print()
        print_side_by_side(results["ferry"], results["reference"])
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
