"""A local stand-in for the GitHub Releases REST API, which tests cannot reach.

It implements the endpoints `workflows/release/github.py` uses, with the public API's status
codes: list/create/update releases (200/201), list assets (200), upload an asset to the
`upload_url` (201, 422 when the name exists), update an asset's label (200), delete an asset
(204, 404 when gone), 401 without the right bearer token. Assets carry `digest: sha256:...` as
GitHub's do. `fail_uploads` injects 502s, optionally after storing the asset (a lost answer).
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class FakeGitHub:
    token: str = "test-token"
    releases: list[dict[str, Any]] = field(default_factory=list)
    assets: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    log: list[tuple[str, str]] = field(default_factory=list)
    fail_uploads: dict[str, list[str]] = field(default_factory=dict)  # name -> ["502", "lost"]
    base_url: str = ""
    _ids: int = 100
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def next_id(self) -> int:
        self._ids += 1
        return self._ids

    def add_release(self, name: str, tag: str, assets: dict[str, bytes]) -> dict[str, Any]:
        release = self._new_release({"name": name, "tag_name": tag, "draft": False,
                                     "prerelease": False})
        for asset_name, data in assets.items():
            self._store_asset(release["id"], asset_name, data, None)
        return release

    def _new_release(self, body: dict[str, Any]) -> dict[str, Any]:
        rid = self.next_id()
        release = {"id": rid, "name": body.get("name"), "tag_name": body["tag_name"],
                   "draft": bool(body.get("draft")), "prerelease": bool(body.get("prerelease")),
                   "upload_url": f"{self.base_url}/uploads/repos/o/r/releases/{rid}/assets"
                                 "{?name,label}"}
        self.releases.append(release)
        self.assets[rid] = []
        return release

    def _store_asset(self, rid: int, name: str, data: bytes, label: str | None,
                     state: str = "uploaded") -> dict[str, Any]:
        asset = {"id": self.next_id(), "name": name, "label": label, "size": len(data),
                 "state": state, "digest": "sha256:" + hashlib.sha256(data).hexdigest(),
                 "updated_at": _now(), "data": data}
        self.assets[rid].append(asset)
        return asset

    def asset_files(self, rid: int) -> dict[str, bytes]:
        return {a["name"]: a["data"] for a in self.assets[rid]}

    def app(self) -> Starlette:
        repo = "/repos/{owner}/{repo}"
        routes = [
            Route(repo + "/releases", self.releases_route, methods=["GET", "POST"]),
            Route(repo + "/releases/{rid:int}", self.update_release, methods=["PATCH"]),
            Route(repo + "/releases/{rid:int}/assets", self.list_assets, methods=["GET"]),
            Route(repo + "/releases/assets/{aid:int}", self.asset_route,
                  methods=["PATCH", "DELETE"]),
            Route("/uploads" + repo + "/releases/{rid:int}/assets", self.upload,
                  methods=["POST"]),
        ]
        return Starlette(routes=routes, middleware=[])

    def _authorized(self, request: Request) -> bool:
        self.log.append((request.method, str(request.url)))
        return request.headers.get("authorization") == f"Bearer {self.token}"

    async def releases_route(self, request: Request) -> Response:
        if not self._authorized(request):
            return JSONResponse({"message": "Bad credentials"}, 401)
        if request.method == "GET":
            return JSONResponse(self.releases)
        body = await request.json()
        if any(r["tag_name"] == body["tag_name"] for r in self.releases):
            return JSONResponse({"message": "Validation Failed",
                                 "errors": [{"code": "already_exists"}]}, 422)
        return JSONResponse(self._new_release(body), 201)

    async def update_release(self, request: Request) -> Response:
        if not self._authorized(request):
            return JSONResponse({"message": "Bad credentials"}, 401)
        release = next((r for r in self.releases if r["id"] == request.path_params["rid"]), None)
        if release is None:
            return JSONResponse({"message": "Not Found"}, 404)
        release.update(await request.json())
        return JSONResponse(release)

    async def list_assets(self, request: Request) -> Response:
        if not self._authorized(request):
            return JSONResponse({"message": "Bad credentials"}, 401)
        rid = request.path_params["rid"]
        if rid not in self.assets:
            return JSONResponse({"message": "Not Found"}, 404)
        return JSONResponse([{k: v for k, v in a.items() if k != "data"}
                             for a in self.assets[rid]])

    async def asset_route(self, request: Request) -> Response:
        if not self._authorized(request):
            return JSONResponse({"message": "Bad credentials"}, 401)
        aid = request.path_params["aid"]
        for assets in self.assets.values():
            for asset in assets:
                if asset["id"] == aid:
                    if request.method == "DELETE":
                        assets.remove(asset)
                        return Response(status_code=204)
                    asset.update(label=(await request.json()).get("label"), updated_at=_now())
                    return JSONResponse({k: v for k, v in asset.items() if k != "data"})
        return JSONResponse({"message": "Not Found"}, 404)

    async def upload(self, request: Request) -> Response:
        if not self._authorized(request):
            return JSONResponse({"message": "Bad credentials"}, 401)
        rid, name = request.path_params["rid"], request.query_params["name"]
        data = await request.body()
        if int(request.headers.get("content-length", -1)) != len(data):
            return JSONResponse({"message": "Content-Length mismatch"}, 400)
        with self._lock:
            if any(a["name"] == name for a in self.assets.get(rid, [])):
                return JSONResponse({"message": "Validation Failed", "errors": [
                    {"resource": "ReleaseAsset", "code": "already_exists", "field": "name"}]},
                    422)
            fault = self.fail_uploads.get(name, [])
            action = fault.pop(0) if fault else None
            if action == "502":
                return JSONResponse({"message": "Bad Gateway"}, 502)
            asset = self._store_asset(rid, name, data, request.query_params.get("label"))
        if action == "lost":
            return JSONResponse({"message": "Bad Gateway"}, 502)
        return JSONResponse({k: v for k, v in asset.items() if k != "data"}, 201)
