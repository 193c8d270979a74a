"""`ferry release publish`: publish a version's release assets with a checksum manifest.

The job itself is `workflows.release.job.publish`; this module parses flags, renders progress
(one bar per asset) and the summary table, and turns the outcome into the exit status: 0 only
when every asset, the checksum file last, is published and verified.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TaskID, TextColumn
from rich.table import Table

from ferry.config import Settings


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("release", help="publish release assets (GitHub, S3, OCI)")
    actions = parser.add_subparsers(dest="release_command", metavar="ACTION", required=True)
    publish = actions.add_parser("publish", help="publish a version's files and sha256sum.txt")
    publish.add_argument("--tag", required=True, help="the git tag, vX.Y.Z or vX.Y.Z-rcN")
    publish.add_argument("--dist", required=True, type=Path, help="directory of files to publish")
    publish.add_argument("--store", required=True,
                         help="github://OWNER/REPO, s3://BUCKET/PREFIX or oci://HOST/NS/REPO")
    publish.add_argument("--retry-delays", default="15,30", type=_delays,
                         help="seconds to wait before each retry (default 15,30)")
    publish.add_argument("--parallel", default=8, type=int, help="uploads in flight (default 8)")
    publish.add_argument("--api-url", help="GitHub API base (GitHub Enterprise)")
    publish.add_argument("--endpoint-url", help="S3 endpoint (default: AWS_ENDPOINT_URL)")
    publish.add_argument("--insecure", action="store_true", help="OCI registry over plain HTTP")
    publish.add_argument("--lease-ttl", default=300.0, type=float,
                         help="seconds a lease lives unless renewed (default 300)")
    publish.add_argument("--lease-wait", default=900.0, type=float,
                         help="seconds to wait for another run's lease; 0 fails at once")
    publish.set_defaults(func=run_publish)


def _delays(text: str) -> tuple[float, ...]:
    try:
        delays = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected seconds like 15,30, got {text!r}") from exc
    if any(d < 0 for d in delays):
        raise argparse.ArgumentTypeError("retry delays cannot be negative")
    return delays


def run_publish(args: argparse.Namespace, settings: Settings) -> int:
    from workflows.release.job import PublishOptions, publish
    from workflows.release.store import ReleaseError
    from workflows.release.stores import StoreOptions, open_store

    console = Console(stderr=True, soft_wrap=True)  # messages stay whole lines for grep
    options = PublishOptions(retry_delays=args.retry_delays, parallel=max(1, args.parallel),
                             lease_ttl=args.lease_ttl, lease_wait=args.lease_wait,
                             lease_poll=min(5.0, max(0.2, args.lease_ttl / 10)))
    store_options = StoreOptions(github_token=settings.github_token, api_url=args.api_url,
                                 endpoint_url=args.endpoint_url or settings.aws_endpoint_url,
                                 insecure=args.insecure)
    try:
        store = open_store(args.store, store_options)
        try:
            with _Renderer(console) as renderer:
                report = publish(store, args.tag, args.dist, options, renderer.emit)
        finally:
            store.close()
    except ReleaseError as exc:
        console.print(f"[red]release failed:[/red] {exc}")
        return 1
    _print_summary(report)
    for problem in report.problems:
        console.print(f"[red]error:[/red] {problem}")
    return 0 if report.ok else 1


class _Renderer:
    """Turns job events into rich output: a bar per asset, a line per step, retry and failure."""

    def __init__(self, console: Console) -> None:
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                 console=console, redirect_stdout=False, redirect_stderr=False)
        self.tasks: dict[str, TaskID] = {}

    def __enter__(self) -> _Renderer:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def emit(self, event: object) -> None:
        from workflows.release.job import Event

        assert isinstance(event, Event)
        out = self.progress.console
        if event.kind == "step":
            out.print(event.message)
        elif event.kind == "start" and event.asset:
            if event.asset not in self.tasks:
                self.tasks[event.asset] = self.progress.add_task(event.asset, total=event.total)
        elif event.kind in ("progress", "done") and event.asset in self.tasks:
            self.progress.update(self.tasks[event.asset], completed=event.completed)
        elif event.kind == "retry":
            name = event.asset or "cleanup"
            out.print(f"[yellow]retry[/yellow] {name} in {event.delay:g}s: {event.message}")
        elif event.kind == "failed":
            out.print(f"[red]failed[/red] {event.asset}: {event.message}")


def _print_summary(report: object) -> None:
    from workflows.release.job import PublishReport

    assert isinstance(report, PublishReport)
    console = Console(width=120)
    console.print(f"release {report.ref.name}: tag {report.ref.tag}, {report.retag}")
    table = Table(title=f"release {report.ref.name}")
    for column in ("asset", "size", "attempts", "status"):
        table.add_column(column)
    for asset in report.assets:
        table.add_row(asset.name, str(asset.size), str(asset.attempts), asset.status)
    console.print(table)
