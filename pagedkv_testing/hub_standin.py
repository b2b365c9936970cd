"""A local stand-in for the Hugging Face Hub: serves model folders the way the Hub's API and its
``resolve`` URLs do, for ``huggingface_hub`` pointed at it with ``HF_ENDPOINT``.

Routes (what ``snapshot_download`` asks for):

- ``GET /api/models/{repo}/revision/{rev}``: the repo's info (its commit ``sha``, its files);
- ``GET /api/models/{repo}/tree/{commit}``: the file list with sizes (safetensors as LFS files);
- ``HEAD|GET /{repo}/resolve/{rev}/{file}``: the file, with ``X-Repo-Commit`` and ``ETag``
  (``X-Linked-Etag`` / ``X-Linked-Size`` for an LFS file).

An unknown repo is a 404 with ``X-Error-Code: RepoNotFound``, an unknown revision one with
``RevisionNotFound``, as the Hub answers. ``requests`` records every path asked for.
"""

from __future__ import annotations

import hashlib
import json
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class HubStandIn:
    def __init__(self, repos: dict[str, Path], commit: str = "0123456789abcdef0123456789abcdef01234567") -> None:
        self.repos = {name: {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
                      for name, folder in repos.items()}
        self.commit = commit
        self.requests: list[str] = []
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                stand_in._answer(self, body=False)

            def do_GET(self) -> None:
                stand_in._answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> HubStandIn:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _revision_ok(self, rev: str) -> bool:
        return rev in ("main", self.commit)

    def _answer(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = urllib.parse.urlsplit(h.path).path
        self.requests.append(path)
        parts = [urllib.parse.unquote(p) for p in path.strip("/").split("/")]
        if parts[:2] == ["api", "models"] and len(parts) >= 6:
            repo, kind, rev = "/".join(parts[2:4]), parts[4], parts[5]
            if repo not in self.repos:
                return self._error(h, 404, "RepoNotFound", body)
            if not self._revision_ok(rev):
                return self._error(h, 404, "RevisionNotFound", body)
            files = self.repos[repo]
            if kind == "revision":
                info = {"id": repo, "modelId": repo, "sha": self.commit, "private": False,
                        "siblings": [{"rfilename": name} for name in sorted(files)]}
                return self._send(h, 200, json.dumps(info).encode(), body, {"Content-Type": "application/json"})
            if kind == "tree":
                tree = [self._tree_entry(name, data) for name, data in sorted(files.items())]
                return self._send(h, 200, json.dumps(tree).encode(), body, {"Content-Type": "application/json"})
        if len(parts) >= 5 and parts[2] == "resolve":
            repo, rev, name = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
            if repo not in self.repos:
                return self._error(h, 404, "RepoNotFound", body)
            if not self._revision_ok(rev):
                return self._error(h, 404, "RevisionNotFound", body)
            data = self.repos[repo].get(name)
            if data is None:
                return self._error(h, 404, "EntryNotFound", body)
            headers = {"X-Repo-Commit": self.commit, "ETag": f'"{hashlib.sha1(data).hexdigest()}"',
                       "Content-Type": "application/octet-stream"}
            if _is_lfs(name):
                headers |= {"X-Linked-Etag": f'"{hashlib.sha256(data).hexdigest()}"', "X-Linked-Size": str(len(data))}
            return self._send(h, 200, data, body, headers)
        self._error(h, 404, "EntryNotFound", body)

    @staticmethod
    def _tree_entry(name: str, data: bytes) -> dict:
        entry = {"type": "file", "oid": hashlib.sha1(data).hexdigest(), "size": len(data), "path": name}
        if _is_lfs(name):
            entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        return entry

    def _error(self, h: BaseHTTPRequestHandler, status: int, code: str, body: bool) -> None:
        self._send(h, status, json.dumps({"error": code}).encode(), body,
                   {"X-Error-Code": code, "X-Error-Message": code, "Content-Type": "application/json"})

    @staticmethod
    def _send(h: BaseHTTPRequestHandler, status: int, data: bytes, body: bool, headers: dict[str, str]) -> None:
        h.send_response(status)
        for key, value in headers.items():
            h.send_header(key, value)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if body:
            h.wfile.write(data)


def _is_lfs(name: str) -> bool:
    return name.endswith((".safetensors", ".bin", ".gguf"))
