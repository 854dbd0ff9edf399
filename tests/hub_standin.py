"""A stand-in for the Hugging Face Hub's write API, for offline tests of ``diffpipe push``.

A local HTTP server answering the requests ``huggingface_hub`` sends to create a repository, a
branch and a commit: ``POST /api/repos/create``, ``/api/models/{repo}/branch/{branch}``,
``/api/models/{repo}/preupload/{revision}`` (every file uploads "regular": base64 inside the commit,
so no LFS or Xet storage is needed), ``/api/validate-yaml`` (README.md), ``/api/models/{repo}/commit/
{revision}`` (NDJSON), and ``GET /api/models/{repo}/revision/{revision}`` (what a no-op push reads).
It keeps each branch's files in memory and every Authorization header it was sent.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote


def git_blob_sha1(data: bytes) -> str:
    """A file's git object id (what the Hub reports as a regular file's oid)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    private: bool
    branches: dict[str, dict[str, bytes]] = field(default_factory=lambda: {"main": {}})
    commits: list[dict] = field(default_factory=list)


@dataclass
class HubState:
    repos: dict[str, Repo] = field(default_factory=dict)
    authorizations: list[str] = field(default_factory=list)


_REPO = r"/api/models/(?P<repo>[^/]+/[^/]+)"


class _Handler(BaseHTTPRequestHandler):
    state: HubState  # set on the subclass per server

    def log_message(self, *args) -> None:  # quiet: the test reads the state, not a log
        pass

    def _reply(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length", 0)))

    def do_GET(self) -> None:
        self.state.authorizations.append(self.headers.get("Authorization", ""))
        if m := re.fullmatch(_REPO + r"/revision/(?P<rev>[^/?]+)(\?.*)?", self.path):
            repo = self.state.repos.get(m["repo"])
            if repo is None:
                return self._reply(404, {"error": "Repository not found"})
            files = repo.branches.get(unquote(m["rev"]), {})
            return self._reply(200, {"id": m["repo"], "sha": _head(repo), "private": repo.private,
                                     "siblings": [{"rfilename": f} for f in sorted(files)]})
        self._reply(404, {"error": f"no route GET {self.path}"})

    def do_POST(self) -> None:
        self.state.authorizations.append(self.headers.get("Authorization", ""))
        body = self._body()
        path = self.path.split("?")[0]
        if path == "/api/repos/create":
            payload = json.loads(body)
            repo_id = f"{payload['organization']}/{payload['name']}" if payload.get("organization") else payload["name"]
            url = f"http://{self.headers['Host']}/{repo_id}"
            if repo_id in self.state.repos:  # the Hub names the repository in its conflict answer too
                return self._reply(409, {"error": "You already created this model repo", "url": url})
            self.state.repos[repo_id] = Repo(private=payload.get("visibility") == "private" or bool(payload.get("private")))
            return self._reply(200, {"url": url})
        if path == "/api/validate-yaml":
            return self._reply(200, {})
        m = re.fullmatch(_REPO + r"/(?P<op>branch|preupload|commit)/(?P<rev>[^/]+)", path)
        if m is None or m["repo"] not in self.state.repos:
            return self._reply(404, {"error": f"no route POST {self.path}"})
        repo, rev = self.state.repos[m["repo"]], unquote(m["rev"])
        if m["op"] == "branch":
            if rev in repo.branches:
                return self._reply(409, {"error": "Branch already exists"})
            repo.branches[rev] = dict(repo.branches["main"])
            return self._reply(200, {})
        files = repo.branches.get(rev)
        if files is None:
            return self._reply(404, {"error": f"Revision not found: {rev}"})
        if m["op"] == "preupload":
            return self._reply(200, {"files": [
                {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False,
                 "oid": git_blob_sha1(files[f["path"]]) if f["path"] in files else None}
                for f in json.loads(body)["files"]]})
        return self._commit(m["repo"], repo, files, body)

    def _commit(self, repo_id: str, repo: Repo, files: dict[str, bytes], body: bytes) -> None:
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        header = next(x["value"] for x in lines if x["key"] == "header")
        for item in lines:
            if item["key"] == "file":
                assert item["value"]["encoding"] == "base64"
                files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
            elif item["key"] != "header":
                return self._reply(400, {"error": f"the stand-in takes regular files only, not {item['key']}"})
        repo.commits.append({"summary": header["summary"], "paths": [x["value"]["path"] for x in lines[1:]]})
        oid = _head(repo)
        self._reply(200, {"commitUrl": f"http://{self.headers['Host']}/{repo_id}/commit/{oid}", "commitOid": oid})


def _head(repo: Repo) -> str:
    return hashlib.sha1(json.dumps(repo.commits).encode()).hexdigest()


class HubStandIn:
    """``with HubStandIn() as hub:`` a running stand-in at ``hub.url``; ``hub.state`` what it holds."""

    def __init__(self) -> None:
        self.state = HubState()
        handler = type("Handler", (_Handler,), {"state": self.state})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> HubStandIn:
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
