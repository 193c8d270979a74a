"""The release workflow and the deployment files parse and say what the release job needs."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import yaml

from ferry.cli import build_parser

REPO = Path(__file__).resolve().parents[3]
WORKFLOW = REPO / ".github" / "workflows" / "release.yaml"


def _workflow() -> dict:
    return yaml.safe_load(WORKFLOW.read_text())


def test_release_job_runs_in_a_per_version_group_that_is_never_cancelled():
    workflow = _workflow()
    on = workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on` as true
    assert on["push"]["tags"] == ["v*"]
    release = workflow["jobs"]["release"]
    assert release["concurrency"] == {"group": "release-${{ needs.setup.outputs.version }}",
                                      "cancel-in-progress": False}
    assert "setup" in release["needs"] and release["permissions"]["contents"] == "write"


def test_the_version_step_cuts_the_tag_at_the_first_dash(tmp_path):
    step = next(s for s in _workflow()["jobs"]["setup"]["steps"] if s.get("id") == "version")
    for tag, version in [("v1.2.0-rc2", "v1.2.0"), ("v1.2.0", "v1.2.0"),
                         ("v2.0.0-rc1-hotfix", "v2.0.0")]:
        output = tmp_path / f"out-{tag}"
        env = {**os.environ, "GITHUB_REF_NAME": tag, "GITHUB_OUTPUT": str(output)}
        subprocess.run(["bash", "-e", "-c", step["run"]], env=env, check=True)
        assert output.read_text().strip() == f"version={version}"


def test_the_publish_step_is_a_valid_ferry_release_command():
    steps = _workflow()["jobs"]["release"]["steps"]
    publish = next(s for s in steps if "ferry release publish" in s.get("run", ""))
    assert publish["env"]["GITHUB_TOKEN"] == "${{ secrets.GITHUB_TOKEN }}"
    argv = shlex.split(publish["run"].replace("${GITHUB_REF_NAME}", "v1.2.0-rc1")
                       .replace("${{ github.repository }}", "ferry-dev/ferry"))
    assert argv[:3] == ["ferry", "release", "publish"]
    parser, _ = build_parser()
    args = parser.parse_args(argv[1:])
    assert (args.tag, str(args.dist), args.store) == ("v1.2.0-rc1", "dist",
                                                      "github://ferry-dev/ferry")
    assert args.retry_delays == (15.0, 30.0) and args.parallel == 8
    build = " ".join(s.get("run", "") for s in _workflow()["jobs"]["build"]["steps"])
    assert "python -m build" in build and "infra/Dockerfile" in build


def test_compose_runs_both_services_with_volumes():
    compose = yaml.safe_load((REPO / "infra" / "compose.yaml").read_text())
    services = compose["services"]
    assert services["model-server"]["command"] == ["serve"]
    assert services["registry"]["command"] == ["registry", "serve", "--auth",
                                               "/data/auth/auth.toml"]
    for service in services.values():  # published on loopback only
        assert all(str(p).startswith("127.0.0.1:") for p in service.get("ports", []))
    assert {"models", "registry"} <= set(compose["volumes"])
    dockerfile = (REPO / "infra" / "Dockerfile").read_text()
    assert dockerfile.startswith("#") and "FROM python:3.11-slim" in dockerfile
    assert "pip install ." in dockerfile and 'ENTRYPOINT ["ferry"]' in dockerfile


def test_k8s_manifests_pair_each_deployment_with_a_service_and_a_claim():
    for name, port in [("registry", 5000), ("model-server", 11434)]:
        docs = list(yaml.safe_load_all((REPO / "infra" / "k8s" / f"{name}.yaml").read_text()))
        kinds = {d["kind"]: d for d in docs}
        assert set(kinds) == {"Deployment", "Service", "PersistentVolumeClaim"}
        pod = kinds["Deployment"]["spec"]["template"]["spec"]
        claim = pod["volumes"][0]["persistentVolumeClaim"]["claimName"]
        assert claim == kinds["PersistentVolumeClaim"]["metadata"]["name"]
        assert pod["containers"][0]["ports"][0]["containerPort"] == port
        assert kinds["Service"]["spec"]["selector"] == \
            kinds["Deployment"]["spec"]["selector"]["matchLabels"]


def test_the_image_copies_every_package_the_wheel_installs():
    """A package left out of the image (or its build context) breaks `ferry` at import."""
    import tomllib

    find = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = [p.rstrip("*") for p in find["packages"]["find"]["include"]]
    dockerfile = (REPO / "infra" / "Dockerfile").read_text()
    context = (REPO / "infra" / "Dockerfile.dockerignore").read_text().splitlines()
    for package in packages:
        assert f"COPY {package} ./{package}" in dockerfile, package
        assert f"!{package}/**" in context, package
