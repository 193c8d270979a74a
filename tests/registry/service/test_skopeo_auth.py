"""skopeo through an authenticated registry: `--dest-creds` pushes, `--creds` pulls and lists,
and without credentials it gets a clear unauthorized error (the token flow every client knows)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from .auth_fixtures import serve_auth_registry, write_auth_file
from .test_skopeo_interop import POLICY, build_oci_layout, run_skopeo, skopeo  # noqa: F401


def test_skopeo_pushes_and_pulls_with_credentials_and_is_refused_without(
        skopeo: str, tmp_path: Path) -> None:
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps(POLICY))
    source = tmp_path / "src"
    digest = build_oci_layout(source, "v1")
    auth_file = write_auth_file(tmp_path)
    with serve_auth_registry(tmp_path, auth_file) as url:
        ref = f"docker://{url.removeprefix('http://')}/team/image"
        plain = ["--dest-tls-verify=false", "--preserve-digests", f"oci:{source}:v1"]
        refused = subprocess.run([skopeo, "--policy", str(policy), "copy", *plain, f"{ref}:v1"],
                                 capture_output=True, text=True, timeout=120)
        assert refused.returncode != 0
        assert "unauthorized" in refused.stderr.lower() or "denied" in refused.stderr.lower()
        wrong = subprocess.run([skopeo, "--policy", str(policy), "copy", "--dest-creds",
                                "alice:wrong", *plain, f"{ref}:v1"],
                               capture_output=True, text=True, timeout=120)
        assert wrong.returncode != 0
        assert "alice-pw" not in wrong.stderr
        run_skopeo(skopeo, policy, "copy", "--dest-creds", "alice:alice-pw", *plain, f"{ref}:v1")
        inspected = json.loads(run_skopeo(skopeo, policy, "inspect", "--tls-verify=false",
                                          "--creds", "bob:bob-pw", f"{ref}:v1"))
        assert inspected["Digest"] == digest
        tags = json.loads(run_skopeo(skopeo, policy, "list-tags", "--tls-verify=false",
                                     "--creds", "bob:bob-pw", ref))
        assert tags["Tags"] == ["v1"]
        out = tmp_path / "out"
        run_skopeo(skopeo, policy, "copy", "--src-tls-verify=false", "--src-creds", "bob:bob-pw",
                   f"{ref}:v1", f"oci:{out}:v1")
        assert json.loads((out / "index.json").read_text())["manifests"][0]["digest"] == digest
        denied = subprocess.run([skopeo, "--policy", str(policy), "delete", "--tls-verify=false",
                                 "--creds", "bob:bob-pw", f"{ref}:v1"],
                                capture_output=True, text=True, timeout=120)
        assert denied.returncode != 0  # bob may pull, not delete
