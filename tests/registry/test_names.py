"""Model names, parsed and validated as Ollama does (reference 1.1)."""

from __future__ import annotations

from pathlib import PurePosixPath

import pytest

from registry.errors import InvalidName
from registry.names import Name, parse_repository

HEX = "a" * 64
R = "registry.ollama.ai"

# text -> (host, namespace, model, tag, scheme, digest) after defaults are merged
VALID = [
    ("llama3", (R, "library", "llama3", "latest", "https", "")),
    ("llama3:8b", (R, "library", "llama3", "8b", "https", "")),
    ("me/llama3", (R, "me", "llama3", "latest", "https", "")),
    ("me/llama3:q4_K_M", (R, "me", "llama3", "q4_K_M", "https", "")),
    ("example.com/me/m:t", ("example.com", "me", "m", "t", "https", "")),
    ("localhost:5000/me/m", ("localhost:5000", "me", "m", "latest", "https", "")),
    ("localhost:5000/me/m:v1", ("localhost:5000", "me", "m", "v1", "https", "")),
    ("127.0.0.1:5000/team/model:1.0", ("127.0.0.1:5000", "team", "model", "1.0", "https", "")),
    ("http://localhost:5000/me/m:t", ("localhost:5000", "me", "m", "t", "http", "")),
    ("https://example.com/me/m", ("example.com", "me", "m", "latest", "https", "")),
    ("qwen2.5:0.5b", (R, "library", "qwen2.5", "0.5b", "https", "")),
    ("_under/_score:_x", (R, "_under", "_score", "_x", "https", "")),
    ("my-ns/my_model-v2.1:tag-1.2_x", (R, "my-ns", "my_model-v2.1", "tag-1.2_x", "https", "")),
    ("MixedCase/Model:TAG", (R, "MixedCase", "Model", "TAG", "https", "")),
    ("h_st/ns/m", ("h_st", "ns", "m", "latest", "https", "")),
    ("9/9/9:9", ("9", "9", "9", "9", "https", "")),
    (f"m@sha256:{HEX}", (R, "library", "m", "latest", "https", f"sha256:{HEX}")),
    (f"me/m:t@sha256:{HEX}", (R, "me", "m", "t", "https", f"sha256:{HEX}")),
    (f"m@sha256-{HEX}", (R, "library", "m", "latest", "https", f"sha256-{HEX}")),
    ("m" * 80, (R, "library", "m" * 80, "latest", "https", "")),
    ("n" * 80 + "/m:" + "t" * 80, (R, "n" * 80, "m", "t" * 80, "https", "")),
    ("h" * 350 + "/n/m", ("h" * 350, "n", "m", "latest", "https", "")),
]

# text -> a fragment of the reason it is invalid
INVALID = [
    ("", "a model name is required"),
    ("   ", "a model name is required"),
    ("../x", "namespace must start with a letter, digit or underscore"),
    ("../../etc/passwd", "must start with a letter, digit or underscore"),
    ("/etc/passwd", "is empty"),
    ("/abs", "namespace is empty"),
    ("%2e%2e/x", "namespace must start"),
    ("x/%2e%2e", "model must start"),
    ("a/..", "model must start"),
    (".hidden", "model must start"),
    ("-dash", "model must start"),
    ("m:", "tag is empty"),
    (":tag", "model is empty"),
    ("ns/", "model is empty"),
    ("h//m", "namespace is empty"),
    ("m:-t", "tag must start"),
    ("m:a:b", "model contains the character ':'"),
    ("ns.dot/m", "namespace contains the character '.'"),
    ("host/ns:x/m", "namespace contains the character ':'"),
    ("m" * 81, "model is longer than 80 characters"),
    ("n" * 81 + "/m", "namespace is longer than 80 characters"),
    ("m:" + "t" * 81, "tag is longer than 80 characters"),
    ("h" * 351 + "/n/m", "host is longer than 350 characters"),
    ("m m", "model contains the character ' '"),
    ("m\n", "model contains the character '\\n'"),
    ("m/é", "model must start with a letter"),
    ("mödel", "model contains the character 'ö'"),
    ("h/n/m\\x", "model contains the character '\\\\'"),
    ("ftp://h/n/m", "unsupported scheme 'ftp'"),
    ("m@sha256:abc", "expected 64 hex characters, got 3"),
    ("m@", "digest"),
    (f"m@md5:{HEX}", "only sha256 is supported"),
    ("a/b/c/d", "host"),
]


@pytest.mark.parametrize("text, parts", VALID)
def test_valid_names_parse_to_their_parts(text, parts):
    name = Name.parse_valid(text)
    assert (name.host, name.namespace, name.model, name.tag, name.scheme, name.digest) == parts


@pytest.mark.parametrize("text, reason", INVALID)
def test_invalid_names_are_rejected_with_the_reason(text, reason):
    with pytest.raises(InvalidName) as info:
        Name.parse_valid(text)
    assert reason in info.value.message
    assert not Name.parse(text).is_valid


def test_the_tables_cover_at_least_forty_cases():
    assert len(VALID) + len(INVALID) >= 40


def test_a_valid_name_never_leaves_the_manifests_dir():
    for text, _ in VALID:
        path = Name.parse_valid(text).manifest_relpath
        assert not path.is_absolute()
        assert ".." not in path.parts and len(path.parts) == 4


def test_host_port_keeps_its_port_and_the_path_keeps_the_case():
    name = Name.parse_valid("LocalHost:5000/Team/Model:Tag")
    assert name.manifest_relpath == PurePosixPath("LocalHost:5000", "Team", "Model", "Tag")
    assert name.base_url == "https://LocalHost:5000"
    assert name.repository == "Team/Model"
    assert str(name) == "LocalHost:5000/Team/Model:Tag"


def test_parse_bare_leaves_absent_parts_empty():
    bare = Name.parse_bare("m")
    assert (bare.host, bare.namespace, bare.model, bare.tag) == ("", "", "m", "")
    assert Name.parse_bare("ns/m:t").namespace == "ns"


@pytest.mark.parametrize("text, shortest", [
    ("llama3", "llama3:latest"),
    ("library/llama3:8b", "llama3:8b"),
    ("registry.ollama.ai/library/llama3:8b", "llama3:8b"),
    ("REGISTRY.OLLAMA.AI/LIBRARY/m:t", "m:t"),
    ("me/m", "me/m:latest"),
    ("registry.ollama.ai/me/m:t", "me/m:t"),
    ("example.com/library/m:t", "example.com/library/m:t"),
    ("localhost:5000/me/m", "localhost:5000/me/m:latest"),
])
def test_display_shortest_drops_only_default_prefixes(text, shortest):
    assert Name.parse_valid(text).display_shortest() == shortest


def test_names_compare_case_insensitively():
    a, b = Name.parse_valid("Me/Model:Tag"), Name.parse_valid("me/model:tag")
    assert a == b and hash(a) == hash(b)
    assert a != Name.parse_valid("me/model:other")
    assert len({a, b}) == 1
    assert Name.parse_valid(f"m@sha256:{HEX.upper()}") == Name.parse_valid(f"m@sha256:{HEX}")


@pytest.mark.parametrize("repo, ok", [
    ("library/llama3", True), ("a/b/c", True), ("a.b/c-d__e", True), ("Upper/x", False),
    ("../x", False), ("a//b", False), ("/a", False), ("a/", False), ("a" * 256, False),
])
def test_oci_repository_paths(repo, ok):
    if ok:
        assert parse_repository(repo) == repo
    else:
        with pytest.raises(InvalidName):
            parse_repository(repo)
