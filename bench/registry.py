"""Benchmark: ferry's registry service beside Debian's docker-registry, in one run.

Starts both on loopback over fresh temp directories (filesystem storage), drives each with
`../shared/bench/regbench.py` (same arguments, same seed), and prints every figure side by side
with the ratio ferry/reference (throughput: higher is better for ferry). Each group of phases runs
against every server before the next group starts, and the whole set repeats `--rounds` times;
the table shows each figure's median over the rounds. (On this shared two-core box one pass is
not enough: single passes of the same build put auth/open anywhere from 0.1x to 3x.) A third
server, ferry with `--auth` (the same phases through a Bearer token that regbench fetches once
and reuses, as real clients do; rate limits set out of reach so only their bookkeeping is
measured), runs beside them; `--no-auth-run` skips it.

auth/open is a paired figure: the two ferry runs of a group always run back to back (which one
goes first alternates, and the reference runs before the pair in two rounds of four, after it in
the other two), and the column is the median over rounds of each round's ratio. Before, this
script divided the median of one server's rounds by the other's, under a rotation that put the
auth run right after the open one and the open one right after the reference in nearly every
group: runs made minutes apart, under different load, each always in the same place.
Beside it, `srv us/op` is the server process's CPU time per operation (from /proc, as regbench
reports it), which moves far less with the machine's load than throughput does, and `+auth` what
auth adds to it, paired like auth/open (the median over rounds of each round's auth/open CPU
per operation; regbench reads it in 10 ms clock ticks, so a phase of under ~0.5 s of server CPU
is a few percent coarse). Run by hand:

    .venv/bin/python bench/registry.py                 # the full run (minutes)
    .venv/bin/python bench/registry.py --big-mib 128   # quicker; other regbench flags pass through
    .venv/bin/python bench/registry.py --rounds 2      # quicker, and noisier
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
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


def _key(row: dict) -> str:
    """The figure a row is compared by: MiB/s for bulk transfers, ops/s for the rest."""
    bulk = row.get("mib_s") is not None and not row["name"].startswith("small")
    return "mib_s" if bulk else "ops_s"


def _cpu_per_op(row: dict) -> float | None:
    """The server's CPU microseconds per operation, or None without a reading."""
    cpu, ops = row.get("server_cpu_s"), row.get("ops")
    return cpu / ops * 1e6 if cpu is not None and ops else None


def print_side_by_side(ferry: dict, reference: dict, auth: dict | None = None,
                       paired: dict[str, float | None] | None = None,
                       paired_cpu: dict[str, float] | None = None) -> None:
    ref_rows = {row["name"]: row for row in reference["summary"]}
    auth_rows = {row["name"]: row for row in (auth or {"summary": []})["summary"]}
    header = f"{'phase':34} {'ferry':>10} {'reference':>10} {'unit':>6} {'ratio':>7}"
    if auth is not None:
        header += (f" {'ferry+auth':>10} {'auth/open':>9} {'auth/ref':>8}"
                   f" {'srv us/op':>9} {'+auth':>6}")
    print(header)
    print("-" * len(header))
    for row in ferry["summary"]:
        ref = ref_rows.get(row["name"], {})
        key = _key(row)
        unit = "MiB/s" if key == "mib_s" else "ops/s"
        mine, theirs = row.get(key), ref.get(key)
        line = f"{row['name']:34} {mine or 0:10.1f} {theirs or 0:10.1f} {unit:>6} "
        line += _ratio(mine, theirs)
        if auth is not None:
            authed_row = auth_rows.get(row["name"], {})
            authed = authed_row.get(key)
            pair = (paired or {}).get(row["name"])
            line += f" {authed or 0:10.1f} {f'{pair:6.2f}x' if pair else '      -':>9}"
            line += f" {_ratio(authed, theirs):>8}"
            open_cpu, auth_cpu = _cpu_per_op(row), _cpu_per_op(authed_row)
            cpu_ratio = (paired_cpu or {}).get(row["name"])
            if cpu_ratio is None and open_cpu and auth_cpu:
                cpu_ratio = auth_cpu / open_cpu
            if open_cpu and cpu_ratio:
                line += f" {open_cpu:9.0f} {(cpu_ratio - 1) * 100:+5.0f}%"
        print(line)


def median_summary(rounds: list[list[dict]]) -> dict:
    """One summary from several rounds' rows: each figure the median over the rounds."""
    by_name: dict[str, list[dict]] = {}
    for rows in rounds:
        for row in rows:
            by_name.setdefault(row["name"], []).append(row)
    summary = []
    for rows in by_name.values():
        merged = dict(rows[0])
        for key in ("mib_s", "ops_s", "server_cpu_s"):
            values = [row[key] for row in rows if row.get(key) is not None]
            merged[key] = statistics.median(values) if values else None
        summary.append(merged)
    return {"summary": summary}


def round_ratios(ferry: list[list[dict]], auth: list[list[dict]], cpu: bool = False
                 ) -> dict[str, list[float]]:
    """auth/open of every phase in every round (the two ran back to back in each): of the
    throughput, or with `cpu` of the server's CPU time per operation."""
    ratios: dict[str, list[float]] = {}
    for mine, theirs in zip(auth, ferry, strict=True):
        authed = {r["name"]: r for r in mine}
        for row in theirs:
            if cpu:
                a, o = _cpu_per_op(authed.get(row["name"], {})), _cpu_per_op(row)
            else:
                key = _key(row)
                a, o = authed.get(row["name"], {}).get(key), row.get(key)
            if a and o:
                ratios.setdefault(row["name"], []).append(a / o)
    return ratios


def print_auth_rounds(ratios: dict[str, list[float]], title: str = "auth/open per round"
                      ) -> None:
    """auth/open in each round, to show the spread behind the medians."""
    rounds = max((len(r) for r in ratios.values()), default=0)
    heads = " ".join(f"{f'r{i + 1}':>7}" for i in range(rounds))
    print(f"\n{title:34} {heads}")
    for name, values in ratios.items():
        print(f"{name:34} " + " ".join(f"{v:6.2f}x" for v in values))


def round_order(labels: list[str], turn: int) -> list[str]:
    """The servers' order in round `turn`: the two ferry runs adjacent, which goes first
    alternating, and the reference before the pair or after it (a balanced 4-round cycle:
    each ferry run is first of the pair twice and next to the reference twice)."""
    pair = [label for label in labels if label.startswith("ferry")]
    others = [label for label in labels if not label.startswith("ferry")]
    if turn % 2 == 1:
        pair.reverse()
    return others + pair if (turn // 2 + turn) % 2 == 0 else pair + others


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
    parser.add_argument("--rounds", type=int, default=4,
                        help="passes over every group and server, order changed each pass; "
                        "the table shows medians (default: %(default)s, one full cycle of "
                        "orders)")
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
        # Group by group, every server in turn, so a burst of load on this shared machine hits
        # them alike; the order changes each round so none always runs first or last.
        labels = list(servers)
        rounds: dict[str, list[list[dict]]] = {label: [] for label in labels}
        for turn in range(max(1, args.rounds)):
            order = round_order(labels, turn)
            for label in labels:
                rounds[label].append([])
            for number, group in enumerate(args.groups.split(";")):
                for label in order:
                    proc, url = servers[label]
                    out = work / f"{label.replace('+', '-')}-{turn}-{number}.json"
                    creds = ["--user", ":".join(AUTH_USER)] if label == "ferry+auth" else []
                    got = run_regbench(url, proc.pid, out,
                                       ["--phases", group, "-q", *creds, *extra], args.seed)
                    rounds[label][-1] += got["summary"]
        results = {label: median_summary(rows) for label, rows in rounds.items()}
        print()
        print(f"medians of {max(1, args.rounds)} round(s); load average {os.getloadavg()}")
        ratios = (round_ratios(rounds["ferry"], rounds["ferry+auth"])
                  if "ferry+auth" in rounds else {})
        paired = {name: statistics.median(values) for name, values in ratios.items()}
        cpu_ratios = (round_ratios(rounds["ferry"], rounds["ferry+auth"], cpu=True)
                      if "ferry+auth" in rounds else {})
        paired_cpu = {name: statistics.median(values) for name, values in cpu_ratios.items()}
        print_side_by_side(results["ferry"], results["reference"], results.get("ferry+auth"),
                           paired, paired_cpu)
        if ratios:
            print_auth_rounds(ratios)
        if cpu_ratios:
            print_auth_rounds(cpu_ratios, "auth/open server CPU/op per round")
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
