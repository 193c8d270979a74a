"""Scopes of the distribution token spec, and the `access` claim a token carries.

A scope is `repository:<name>:<action>[,<action>...]` or `registry:catalog:*`. The token's
`access` claim lists what was granted in the same shape:
`[{"type": "repository", "name": "ns/model", "actions": ["pull"]}]`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from registry.names import parse_repository

ACTIONS = ("pull", "push", "delete")
MAX_SCOPES = 64  # per token request; more is a 400, not a slow request
CATALOG = ("registry", "catalog")


class ScopeInvalid(ValueError):
    """A scope string that does not parse; the token endpoint answers 400."""


@dataclass(frozen=True)
class Scope:
    type: str
    name: str
    actions: frozenset[str]

    def claim(self) -> dict[str, object]:
        return {"type": self.type, "name": self.name, "actions": sorted(self.actions)}

    def header(self) -> str:
        """As a challenge's `scope` parameter writes it (pull before push before delete)."""
        if (self.type, self.name) == CATALOG:
            return "registry:catalog:*"
        return f"{self.type}:{self.name}:{','.join(a for a in ACTIONS if a in self.actions)}"


def parse_scope(text: str) -> Scope:
    kind, _, rest = text.partition(":")
    name, _, actions = rest.rpartition(":")
    if not kind or not name or not actions:
        raise ScopeInvalid(f"scope {text[:100]!r} is not <type>:<name>:<actions>")
    if (kind, name) == CATALOG:
        if actions != "*":
            raise ScopeInvalid("the catalog scope is registry:catalog:*")
        return Scope(kind, name, frozenset({"*"}))
    if kind != "repository":
        raise ScopeInvalid(f"unknown scope type {kind[:40]!r}")
    wanted = set(actions.split(","))
    if "*" in wanted:
        wanted = (wanted - {"*"}) | set(ACTIONS)
    unknown = wanted - set(ACTIONS)
    if unknown:
        raise ScopeInvalid(f"unknown actions {sorted(unknown)[:5]} (pull, push, delete)")
    return Scope(kind, parse_repository(name), frozenset(wanted))


def parse_scopes(values: Iterable[str]) -> list[Scope]:
    """Every scope in the request's `scope` parameters (each may hold several, space-separated)."""
    texts = [part for value in values for part in value.split()]
    if len(texts) > MAX_SCOPES:
        raise ScopeInvalid(f"at most {MAX_SCOPES} scopes per token request, got {len(texts)}")
    return [parse_scope(text) for text in texts]


def covers(access: object, repo: str, action: str) -> bool:
    """Does an `access` claim grant `action` on repository `repo`?"""
    if not isinstance(access, list):
        return False
    for entry in access:
        if (isinstance(entry, dict) and entry.get("type") == "repository"
                and entry.get("name") == repo):
            actions = entry.get("actions")
            if isinstance(actions, list) and action in actions:
                return True
    return False


def granted_actions(access: object, repo: str) -> set[str]:
    """Every action the claim grants on `repo` (to keep them in the next challenge's scope)."""
    return {a for a in ACTIONS if covers(access, repo, a)}


def has_catalog(access: object) -> bool:
    return isinstance(access, list) and any(
        isinstance(e, dict) and (e.get("type"), e.get("name")) == CATALOG for e in access)
