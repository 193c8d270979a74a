#!/usr/bin/env python3
"""Benchmark: `ferry create --quantize` end to end versus `mlx_lm.convert -q`, same checkpoint.

    .venv/bin/python bench/create.py [--preset medium] [--arch llama] [--types int4,int8,...]

For each quantize type, a fresh `ferry serve` (own FERRY_HOME) runs, and the `ferry create`
CLI uploads the checkpoint and asks the server to quantize it (the safetensors files stream to
upload sessions, hashed as they are sent, while the server already quantizes what arrived).
Measured: the CLI's wall time (upload included), the server's peak RSS during the create
(sampled every 10 ms) and the CLI's; then, for a breakdown, the same create again under another
name (every blob is on the server now and the CLI's digest cache knows the files, so nothing is
hashed or uploaded: "no upload") and the time a separate hash pass over the checkpoint would
take ("hash").
mlx-lm runs `mlx_lm.convert` on the same checkpoint (affine int4/int8 with group size 64, or
the fp modes); its wall time and peak RSS (the whole process: it loads the model) are sampled
the same way. The machine may be shared, so each pair runs `--repeat` times, alternating, with
the checkpoint in the page cache first, and the best wall time (and its run's peaks) is kept.
Prints every pair (the spread, with the 1-minute load average, and each side's CPU seconds:
ferry's is the server's and the CLI's together, steadier than wall time on a shared machine),
then one table.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
# A worktree has `shared` as a link inside it; the main checkout has it beside.
SHARED = REPO / "shared" if (REPO / "shared").is_dir() else REPO.parent / "shared"
MAKE_CHECKPOINT = SHARED / "fixtures" / "make_checkpoint.py"
PYTHON = sys.executable
MLX_LM_ARGS = {
    "int4": ["--q-bits", "4", "--q-group-size", "64"],
    "int8": ["--q-bits", "8", "--q-group-size", "64"],
    "nvfp4": ["--q-mode", "nvfp4"],
    "mxfp4": ["--q-mode", "mxfp4"],
    "mxfp8": ["--q-mode", "mxfp8"],
}


class PeakRSS:
    """Samples a process's RSS (plus its children's) in a thread until stopped."""

    def __init__(self, pid: int, interval: float = 0.01) -> None:
        self.proc, self.interval, self.peak = psutil.Process(pid), interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                rss = self.proc.memory_info().rss
                rss += sum(c.memory_info().rss for c in self.proc.children(recursive=True))
            except psutil.Error:
                return
            self.peak = max(self.peak, rss)
            time.sleep(self.interval)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def build_checkpoint(out: Path, preset: str, arch: str) -> Path:
    if not (out / "config.json").exists():
        print(f"building the {preset} {arch} fixture in {out} ...", flush=True)
        subprocess.run([PYTHON, str(MAKE_CHECKPOINT), "--out", str(out), "--preset", preset,
                        "--arch", arch, "--force"], check=True, stdout=subprocess.DEVNULL)
    return out


def warm_page_cache(ckpt: Path) -> None:
    """Read the checkpoint once, so neither tool pays for a cold disk the other did not."""
    for path in ckpt.iterdir():
        with open(path, "rb") as fh:
            while fh.read(1 << 24):
                pass


def hash_seconds(ckpt: Path) -> float:
    from registry.digests import sha256_file

    start = time.perf_counter()
    for path in ckpt.iterdir():
        sha256_file(str(path))
    return time.perf_counter() - start


def run_measured(cmd: list[str], env: dict[str, str]) -> tuple[float, int, float]:
    """Wall seconds, peak RSS bytes and CPU seconds of a command (and its children)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    with PeakRSS(proc.pid) as rss:
        _, err = proc.communicate()
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{err.decode()[-2000:]}")
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return wall, rss.peak, cpu


def cpu_seconds(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def wait_for_temp_files(blobs: Path, timeout: float = 120) -> None:
    """Until the server made the uploaded files durable (after the create, in the background),
    so that work lands on neither the next run's clock nor mlx-lm's."""
    deadline = time.monotonic() + timeout
    while any(blobs.glob(".tmp-*")) and time.monotonic() < deadline:
        time.sleep(0.05)


def bench_ferry(ckpt: Path, qtype: str, work: Path) -> dict[str, float]:
    home = work / f"ferry-{qtype}"
    port = free_port()
    env = {**os.environ, "FERRY_HOME": str(home), "FERRY_HOST": f"127.0.0.1:{port}"}
    server = subprocess.Popen([PYTHON, "-m", "ferry.cli", "serve"], env=env, cwd=REPO,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_ready(port)
        idle = psutil.Process(server.pid).memory_info().rss
        (work / "Modelfile").write_text(f"FROM {ckpt}\n")
        cmd = [PYTHON, "-m", "ferry.cli", "create", f"bench/m:{qtype}", "-f",
               str(work / "Modelfile"), "--quantize", qtype]
        server_cpu = cpu_seconds(server.pid)
        with PeakRSS(server.pid) as server_rss:
            wall, cli_peak, cli_cpu = run_measured(cmd, env)
        server_cpu = cpu_seconds(server.pid) - server_cpu
        wait_for_temp_files(home / "models" / "blobs")
        # Again under another name: every blob is on the server now, so no upload happens.
        again, _, _ = run_measured([*cmd[:4], f"bench/again:{qtype}", *cmd[5:]], env)
        return {"wall": wall, "load": os.getloadavg()[0], "cpu": server_cpu + cli_cpu,
                "server_peak": server_rss.peak, "server_idle": idle,
                "cli_peak": cli_peak, "no_upload": again, "hash": hash_seconds(ckpt)}
    finally:
        server.terminate()
        server.wait(timeout=30)
        shutil.rmtree(home, ignore_errors=True)


def _wait_ready(port: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/api/version", timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError("ferry serve did not start")


def bench_mlx_lm(ckpt: Path, qtype: str, work: Path) -> dict[str, float]:
    out = work / f"mlx-{qtype}"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [PYTHON, "-m", "mlx_lm", "convert", "--hf-path", str(ckpt), "--mlx-path", str(out),
           "-q", *MLX_LM_ARGS[qtype]]
    wall, peak, cpu = run_measured(cmd, dict(os.environ))
    shutil.rmtree(out, ignore_errors=True)
    return {"wall": wall, "peak": peak, "cpu": cpu}


def mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="medium")
    parser.add_argument("--arch", default="llama")
    parser.add_argument("--types", default="int4,int8,nvfp4,mxfp4,mxfp8")
    parser.add_argument("--checkpoint", type=Path, help="reuse a fixture dir")
    parser.add_argument("--mlx-lm-types", default="int4,int8",
                        help="types to also run through mlx_lm.convert")
    parser.add_argument("--repeat", type=int, default=2, help="runs per tool and type")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ferry-bench-create-"))
    try:
        ckpt = build_checkpoint(args.checkpoint or work / "ckpt", args.preset, args.arch)
        size = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
        print(f"checkpoint: {args.preset} {args.arch}, {size / 1e9:.2f} GB of safetensors")
        header = (f"{'type':6} | {'ferry wall':>10} | {'no upload':>9} | {'hash':>5} | "
                  f"{'server peak':>11} | {'(idle)':>8} | "
                  f"{'cli peak':>8} | {'mlx-lm wall':>11} | {'mlx-lm peak':>11} | "
                  f"{'wall x':>6} | {'rss x':>5}")
        rows = []
        for qtype in args.types.split(","):
            with_ref = qtype in args.mlx_lm_types.split(",")
            ferry_runs, ref_runs = [], []
            for _ in range(args.repeat):
                warm_page_cache(ckpt)
                ferry_runs.append(bench_ferry(ckpt, qtype, work))
                if with_ref:
                    warm_page_cache(ckpt)
                    ref_runs.append(bench_mlx_lm(ckpt, qtype, work))
            for i, run in enumerate(ferry_runs):  # the spread: every pair, with the load
                pair = f"  run {i + 1}: ferry {run['wall']:.1f}s (cpu {run['cpu']:.1f}s)"
                if ref_runs:
                    ref_run = ref_runs[i]
                    pair += (f", mlx-lm {ref_run['wall']:.1f}s (cpu {ref_run['cpu']:.1f}s), "
                             f"{run['wall'] / ref_run['wall']:.2f}x")
                print(f"{pair} (load {run['load']:.1f})", flush=True)
            ferry = min(ferry_runs, key=lambda r: r["wall"])
            ref = min(ref_runs, key=lambda r: r["wall"]) if ref_runs else None
            rows.append(_row(qtype, ferry, ref))
            print(rows[-1], flush=True)
        print()
        print(header)
        print("\n".join(rows))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _row(qtype: str, ferry: dict[str, float], ref: dict[str, float] | None) -> str:
    base = (f"{qtype:6} | {ferry['wall']:9.1f}s | {ferry['no_upload']:8.1f}s | "
            f"{ferry['hash']:4.1f}s | {mib(ferry['server_peak']):>11} | "
            f"{mib(ferry['server_idle']):>8} | {mib(ferry['cli_peak']):>8}")
    if ref is None:
        return base + f" | {'-':>11} | {'-':>11} | {'-':>6} | {'-':>5}"
    return base + (f" | {ref['wall']:10.1f}s | {mib(ref['peak']):>11} | "
                   f"{ferry['wall'] / ref['wall']:5.2f}x | "
                   f"{ferry['server_peak'] / ref['peak']:4.2f}x")


if __name__ == "__main__":
    sys.exit(main())
