"""A local HTTP test double of the few Hugging Face Hub endpoints hf_csv uses.

Emulated (model repos only, no auth, no LFS/xet: every file is uploaded "regular", base64 in the commit):

* ``GET  /api/models/{org}/{name}/revision/{rev}``  -> ``{"id", "sha", "siblings": [{"rfilename"}]}``
  (what ``snapshot_download`` asks first);
* ``GET  /api/models/{org}/{name}/tree/{rev}``      -> the file list (``snapshot_download`` listing);
* ``HEAD|GET /{org}/{name}/resolve/{rev}/{path}``  -> the file, with ``X-Repo-Commit``, ``ETag`` and
  ``Content-Length`` headers (what ``hf_hub_download`` reads);
* ``POST /api/validate-yaml``                     -> always valid (model-card check before upload);
* ``POST /api/repos/create``                        -> creates the repo (``create_repo``);
* ``POST /api/models/{org}/{name}/branch/{branch}`` -> creates a branch (``create_branch``);
* ``POST /api/models/{org}/{name}/preupload/{rev}`` -> every file "regular" (``create_commit`` step 1);
* ``POST /api/models/{org}/{name}/commit/{rev}``    -> applies the ndjson commit, new commit sha.

Revisions: branch names map to their newest commit; every commit sha stays addressable (pinning).
"""
from __future__ import annotations

import base64
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse


class HubState:
    def __init__(self):
        self.repos: dict[str, dict] = {}  # repo -> {"branches": {name: sha}, "commits": {sha: {path: bytes}}}
        self.requests: list[tuple[str, str]] = []
        self.lock = threading.Lock()

    def create(self, repo: str) -> None:
        self.repos.setdefault(repo, {"branches": {"main": "0" * 40}, "commits": {"0" * 40: {}}})

    def resolve(self, repo: str, rev: str):
        r = self.repos.get(repo)
        if r is None:
            return None, None
        sha = r["branches"].get(rev, rev)
        files = r["commits"].get(sha)
        return (sha, files) if files is not None else (None, None)

    def commit(self, repo: str, branch: str, files: dict[str, bytes]) -> str:
        r = self.repos[repo]
        parent = r["branches"].get(branch, r["branches"]["main"])
        new = dict(r["commits"][parent])
        new.update(files)
        sha = hashlib.sha1(json.dumps(sorted((k, hashlib.sha256(v).hexdigest()) for k, v in new.items())).encode()
                           + parent.encode()).hexdigest()
        r["commits"][sha] = new
        r["branches"][branch] = sha
        return sha


def _handler(state: HubState):
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):  # quiet
            pass

        def _base(self) -> str:
            host, port = self.server.server_address[:2]
            return f"http://{host}:{port}"

        def _send(self, code: int, body: bytes = b"", headers: dict | None = None, head: bool = False):
            self.send_response(code)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _json(self, code: int, obj) -> None:
            self._send(code, json.dumps(obj).encode(), {"Content-Type": "application/json"})

        def _not_found(self, head=False):
            self._send(404, b'{"error": "not found"}', {"X-Error-Code": "RepoNotFound", "Content-Type": "application/json"}, head)

        def _file(self, head: bool):
            parts = unquote(urlparse(self.path).path).strip("/").split("/")
            if len(parts) < 5 or parts[2] != "resolve":
                return self._not_found(head)
            repo, rev, path = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
            sha, files = state.resolve(repo, rev)
            if files is None or path not in files:
                return self._send(404, b"", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": sha or ""}, head)
            data = files[path]
            etag = '"' + hashlib.sha256(data).hexdigest() + '"'
            self._send(200, data, {"X-Repo-Commit": sha, "ETag": etag, "Content-Type": "application/octet-stream"}, head)

        def do_HEAD(self):
            state.requests.append(("HEAD", self.path))
            self._file(head=True)

        def do_GET(self):
            state.requests.append(("GET", self.path))
            p = unquote(urlparse(self.path).path)
            if p.startswith("/api/models/") and "/revision/" in p:
                repo, rev = p[len("/api/models/"):].split("/revision/", 1)
                sha, files = state.resolve(repo, rev)
                if files is None:
                    return self._not_found()
                return self._json(200, {"id": repo, "modelId": repo, "sha": sha, "private": False,
                                        "siblings": [{"rfilename": f} for f in sorted(files)]})
            if p.startswith("/api/models/") and "/tree/" in p:
                repo, rev = p[len("/api/models/"):].split("/tree/", 1)
                sha, files = state.resolve(repo, rev.strip("/"))
                if files is None:
                    return self._not_found()
                return self._json(200, [{"type": "file", "path": f, "size": len(v),
                                         "oid": hashlib.sha1(v).hexdigest()} for f, v in sorted(files.items())])
            self._file(head=False)

        def do_POST(self):
            state.requests.append(("POST", self.path))
            p = unquote(urlparse(self.path).path)
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            with state.lock:
                if p == "/api/validate-yaml":  # upload_folder checks a README's YAML header
                    return self._json(200, {"errors": [], "warnings": []})
                if p == "/api/repos/create":
                    req = json.loads(body)
                    repo = f"{req['organization']}/{req['name']}" if req.get("organization") else req["name"]
                    state.create(repo)
                    return self._json(200, {"url": f"{self._base()}/{repo}", "name": repo})
                if p.startswith("/api/models/"):
                    rest = p[len("/api/models/"):]
                    org, name, action, *tail = rest.split("/")
                    repo, rev = f"{org}/{name}", "/".join(tail) or "main"
                    if repo not in state.repos:
                        return self._not_found()
                    if action == "branch":
                        r = state.repos[repo]
                        r["branches"].setdefault(rev, r["branches"]["main"])
                        return self._json(200, {})
                    if action == "preupload":
                        files = json.loads(body)["files"]
                        return self._json(200, {"files": [{"path": f["path"], "uploadMode": "regular",
                                                           "shouldIgnore": False} for f in files]})
                    if action == "commit":
                        files = {}
                        for line in body.decode().splitlines():
                            item = json.loads(line)
                            if item.get("key") == "file":
                                v = item["value"]
                                files[v["path"]] = base64.b64decode(v["content"])
                        sha = state.commit(repo, rev, files)
                        return self._json(200, {"commitUrl": f"{self._base()}/{repo}/commit/{sha}", "commitOid": sha,
                                                "pullRequestUrl": None})
            self._not_found()

    return H


class HubDouble:
    """Context manager: ``with HubDouble() as hub: hub.endpoint`` is the base URL."""

    def __init__(self):
        self.state = HubState()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self.state))
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "HubDouble":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
