"""A local stand-in for the Hugging Face Hub's HTTP API, on 127.0.0.1, for hotcold.hub's tests (selected
through HF_ENDPOINT): the tree listing `huggingface_hub.HfApi.list_repo_tree` reads, and the `resolve` URLs
`hf_hub_download` reads (HEAD for the commit, ETag and size; GET with Range for resuming), with the Hub's
error headers (X-Error-Code: RepoNotFound, GatedRepo, EntryNotFound). Every request is recorded."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

COMMIT = "c0ffee" + "0" * 34


@dataclass
class Repo:
    files: dict[str, bytes]
    gated_token: str | None = None  # set: requests need "Authorization: Bearer <token>"


@dataclass
class HubStandIn:
    repos: dict[str, Repo] = field(default_factory=dict)
    requests: list[tuple[str, str, dict]] = field(default_factory=list)  # (method, path, headers)
    cut_after: dict[str, int] = field(default_factory=dict)  # file path -> bytes sent before the line drops
    broken: bool = False  # every request answers 500 (the Hub is down)
    lfs: set[str] = field(
        default_factory=set
    )  # file paths served as the Hub serves LFS files: a 302 to a CDN
    etags: dict[str, str] = field(default_factory=dict)  # file path -> the ETag to announce (default: sha256)
    commit: str = COMMIT

    def start(self) -> str:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                hub._answer(self, body=False)

            def do_GET(self):
                hub._answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    # -----------------------------------------------------------------------------------------------

    def _answer(self, h: BaseHTTPRequestHandler, *, body: bool) -> None:
        url = urlparse(h.path)
        path = unquote(url.path)
        self.requests.append((h.command, path, dict(h.headers)))
        if self.broken:
            return _send(h, 500, b"down", body=body)
        cdn = re.match(r"^/cdn/([^/]+/[^/]+)/(.+)$", path)  # the "CDN": another host name for this server
        if cdn:
            repo = self.repos.get(cdn[1])
            data = repo.files.get(cdn[2]) if repo else None
            if data is None:
                return _send(h, 404, b"no such object", body=body)
            ranged = re.match(r"bytes=(\d+)-", h.headers.get("Range", ""))
            start = int(ranged[1]) if ranged else 0
            extra = {"Content-Range": f"bytes {start}-{len(data) - 1}/{len(data)}"} if ranged else {}
            return _send(h, 206 if ranged else 200, data[start:], extra, body=body)
        tree = re.match(r"^/api/models/([^/]+/[^/]+)/tree/([^/]+)(/.*)?$", path)
        resolve = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
        repo_id = (tree or resolve)[1] if (tree or resolve) else None
        repo = self.repos.get(repo_id) if repo_id else None
        if repo is None:
            return _send(h, 401, b"Repository not found", {"X-Error-Code": "RepoNotFound"}, body=body)
        if repo.gated_token and h.headers.get("Authorization") != f"Bearer {repo.gated_token}":
            return _send(h, 401, b"gated", {"X-Error-Code": "GatedRepo"}, body=body)
        if tree:
            return _send(
                h,
                200,
                json.dumps(_listing(repo.files)).encode(),
                {"Content-Type": "application/json"},
                body=body,
            )
        name = resolve[3]
        data = repo.files.get(name)
        if data is None:
            return _send(h, 404, b"Entry not found", {"X-Error-Code": "EntryNotFound"}, body=body)
        etag = self.etags.get(name, hashlib.sha256(data).hexdigest())
        headers = {"X-Repo-Commit": self.commit, "ETag": f'"{etag}"'}
        if name in self.lfs:  # as the Hub: a redirect to the storage host, the file's etag and size alongside
            port = h.server.server_address[1]
            location = f"http://localhost:{port}/cdn/{repo_id}/{name}"
            links = {"Location": location, "X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(len(data))}
            return _send(h, 302, b"", {"X-Repo-Commit": self.commit, **links}, body=body)
        start = 0
        ranged = re.match(r"bytes=(\d+)-", h.headers.get("Range", ""))
        if ranged:
            start = int(ranged[1])
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        cut = self.cut_after.pop(name, None) if body else None
        if cut is not None:  # send the headers for the whole file, part of it, then drop the line
            h.send_response(206 if ranged else 200)
            for k, v in headers.items():
                h.send_header(k, v)
            h.send_header("Content-Length", str(len(data) - start))
            h.end_headers()
            h.wfile.write(data[start : start + cut])
            h.wfile.flush()
            h.close_connection = True
            self.broken = True  # and the Hub stays down until the test heals it
            return
        _send(h, 206 if ranged else 200, data[start:], headers, body=body)


def _listing(files: dict[str, bytes]) -> list[dict]:
    entries, folders = [], set()
    for path in sorted(files):
        parts = path.split("/")
        for i in range(1, len(parts)):
            folders.add("/".join(parts[:i]))
        oid = hashlib.sha1(files[path]).hexdigest()
        entries.append({"type": "file", "oid": oid, "size": len(files[path]), "path": path})
    entries += [{"type": "directory", "oid": "0" * 40, "path": f} for f in sorted(folders)]
    return entries


def _send(h, status: int, data: bytes, headers: dict | None = None, *, body: bool) -> None:
    h.send_response(status)
    for k, v in (headers or {}).items():
        h.send_header(k, v)
    h.send_header("Content-Length", str(len(data)))
    h.end_headers()
    if body:
        h.wfile.write(data)
