"""A Kubernetes API server on loopback that serves EndpointSlices (discovery.k8s.io/v1): list
and watch, as the real one answers them, for the official `kubernetes` client to talk to.

What it does as the real API server does:
- `GET /apis/discovery.k8s.io/v1/namespaces/NS/endpointslices?labelSelector=...` answers an
  `EndpointSliceList` whose `metadata.resourceVersion` is the store's version; its items carry
  no `kind` or `apiVersion` (a list's items do not).
- The same with `watch=true&resourceVersion=RV[&timeoutSeconds=S]` answers 200 with a chunked
  stream of JSON lines, one per event: `{"type": "ADDED" | "MODIFIED" | "DELETED", "object":
  EndpointSlice}`, first the events after RV, then each change as it happens, until S seconds
  have passed (then the stream ends) or the test closes it.
- A watch from a resourceVersion that is no longer kept, or one open when the history is
  compacted (`expire`), gets one event `{"type": "ERROR", "object": Status}` with `code: 410`,
  `reason: Expired` and `message: too old resource version: RV (NOW)`, and the stream ends.
- A request without the kubeconfig's bearer token gets 401, a path it does not serve 404, each
  with a `Status` object.
Label selectors are the equality-based kind (`k=v,k2=v2`), which is all the gateway sends.
"""

from __future__ import annotations

import json
import queue
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import yaml

TOKEN = "fake-kube-token"
_PATH = re.compile(r"^/apis/discovery\.k8s\.io/v1/namespaces/([^/]+)/endpointslices$")
_CLOSE = object()


def _true(query: dict[str, list[str]], key: str) -> bool:
    """A boolean query parameter, read as the API server does (Go's strconv.ParseBool: the
    Python client sends `watch=True`)."""
    return query.get(key, ["false"])[0] in ("1", "t", "T", "true", "TRUE", "True")


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}


def endpoint_slice(name: str, service: str, endpoints: list[dict[str, Any]],
                   port: int, port_name: str = "http", namespace: str = "llm",
                   address_type: str = "IPv4") -> dict[str, Any]:
    """An EndpointSlice as the EndpointSlice controller writes one for a Service."""
    return {
        "metadata": {"name": name, "namespace": namespace, "generateName": f"{service}-",
                     "labels": {"kubernetes.io/service-name": service,
                                "endpointslice.kubernetes.io/managed-by":
                                    "endpointslice-controller.k8s.io"}},
        "addressType": address_type,
        "endpoints": endpoints,
        "ports": [{"name": port_name, "protocol": "TCP", "port": port}],
    }


def endpoint(address: str, ready: bool | None = True, serving: bool | None = None,
             terminating: bool | None = False, pod: str | None = None) -> dict[str, Any]:
    conditions = {k: v for k, v in (("ready", ready),
                                    ("serving", ready if serving is None else serving),
                                    ("terminating", terminating)) if v is not None}
    return {"addresses": [address], "conditions": conditions, "nodeName": "node-1",
            "targetRef": {"kind": "Pod", "namespace": "llm",
                          "name": pod or f"vllm-{address.replace('.', '-')}"}}


class _Watch:
    def __init__(self, namespace: str, selector: dict[str, str]) -> None:
        self.namespace = namespace
        self.selector = selector
        self.events: queue.Queue[Any] = queue.Queue()


class FakeKubeApi:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.version = 1000
        self.slices: dict[tuple[str, str], dict[str, Any]] = {}
        self.history: list[tuple[int, str, dict[str, Any]]] = []
        self.oldest = 0
        """Watches from a resourceVersion below this are told 410 Gone."""
        self.watches: list[_Watch] = []
        self.requests: list[tuple[str, dict[str, list[str]]]] = []
        """(path, query) of every request."""
        self.unavailable = False
        """Answer every request 503 (an API server that cannot serve)."""
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                fake._serve(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.close_watches()
        self.server.shutdown()
        self.server.server_close()

    def kubeconfig(self, path: Path, namespace: str = "llm") -> Path:
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "gateway", "user": {"token": TOKEN}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "gateway",
                                                       "namespace": namespace}}]}))
        return path

    # The store, changed by the test ---------------------------------------------------------

    def put(self, obj: dict[str, Any], announce: bool = True) -> None:
        """Create or replace a slice; `announce=False`: without telling open watches (a
        change only a list shows, as after a compaction)."""
        key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
        with self.lock:
            kind = "MODIFIED" if key in self.slices else "ADDED"
            self.slices[key] = self._stamp(obj)
            if announce:
                self._announce(kind, self.slices[key])

    def delete(self, namespace: str, name: str) -> None:
        with self.lock:
            obj = self.slices.pop((namespace, name))
            self._announce("DELETED", self._stamp(obj))

    def expire(self) -> None:
        """Compact the history: open watches get 410 Gone, and so does a watch from any
        resourceVersion older than the current one."""
        with self.lock:
            self.oldest = self.version  # a list now gives this version: watchable
            gone = json.dumps({"type": "ERROR", "object": status(
                410, "Expired", f"too old resource version: {self.version - 1} "
                f"({self.version})")})
            for w in self.watches:
                w.events.put(gone)
                w.events.put(_CLOSE)

    def close_watches(self) -> None:
        with self.lock:
            for w in self.watches:
                w.events.put(_CLOSE)

    def count(self, watch: bool) -> int:
        """List (or watch) requests served so far."""
        with self.lock:
            return sum(1 for path, q in self.requests if _PATH.match(path)
                       and _true(q, "watch") == watch)

    def _stamp(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        obj = json.loads(json.dumps(obj))
        obj["metadata"]["resourceVersion"] = str(self.version)
        obj["metadata"].setdefault("uid", f"uid-{obj['metadata']['name']}")
        return obj

    def _announce(self, kind: str, obj: dict[str, Any]) -> None:
        self.history.append((self.version, kind, obj))
        for w in self.watches:
            if self._selected(obj, w.namespace, w.selector):
                w.events.put(self._event(kind, obj))

    @staticmethod
    def _event(kind: str, obj: dict[str, Any]) -> str:
        return json.dumps({"type": kind, "object": {
            "kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1", **obj}})

    @staticmethod
    def _selected(obj: dict[str, Any], namespace: str, selector: dict[str, str]) -> bool:
        labels = obj["metadata"].get("labels") or {}
        return (obj["metadata"]["namespace"] == namespace
                and all(labels.get(k) == v for k, v in selector.items()))

    # Serving --------------------------------------------------------------------------------

    def _serve(self, h: BaseHTTPRequestHandler) -> None:
        url = urlsplit(h.path)
        query = parse_qs(url.query)
        with self.lock:
            self.requests.append((url.path, query))
        if h.headers.get("Authorization") != f"Bearer {TOKEN}":
            return self._reply(h, 401, status(401, "Unauthorized", "Unauthorized"))
        if self.unavailable:
            return self._reply(h, 503, status(503, "ServiceUnavailable",
                                              "the server is currently unable to handle "
                                              "the request"))
        m = _PATH.match(url.path)
        if m is None:
            return self._reply(h, 404, status(404, "NotFound", "the server could not find "
                                              "the requested resource"))
        namespace = m.group(1)
        selector = dict(term.split("=", 1) for term in
                        query.get("labelSelector", [""])[0].split(",") if "=" in term)
        if _true(query, "watch"):
            return self._watch(h, namespace, selector, query)
        with self.lock:
            items = [o for o in self.slices.values() if self._selected(o, namespace, selector)]
            body = {"kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1",
                    "metadata": {"resourceVersion": str(self.version)}, "items": items}
        self._reply(h, 200, body)

    def _watch(self, h: BaseHTTPRequestHandler, namespace: str, selector: dict[str, str],
               query: dict[str, list[str]]) -> None:
        since = int(query.get("resourceVersion", ["0"])[0] or 0)
        timeout = float(query.get("timeoutSeconds", ["1800"])[0])
        w = _Watch(namespace, selector)
        with self.lock:
            if since < self.oldest:
                w.events.put(json.dumps({"type": "ERROR", "object": status(
                    410, "Expired", f"too old resource version: {since} ({self.oldest})")}))
                w.events.put(_CLOSE)
            else:
                for version, kind, obj in self.history:
                    if version > since and self._selected(obj, namespace, selector):
                        w.events.put(self._event(kind, obj))
            self.watches.append(w)
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        end = time.monotonic() + timeout
        try:
            while True:
                left = end - time.monotonic()
                if left <= 0:
                    break
                try:
                    item = w.events.get(timeout=min(left, 0.5))
                except queue.Empty:
                    continue
                if item is _CLOSE:
                    break
                data = (item + "\n").encode()
                h.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                h.wfile.flush()
            h.wfile.write(b"0\r\n\r\n")
            h.wfile.flush()
        except OSError:
            pass  # the client went away
        finally:
            with self.lock:
                self.watches.remove(w)
            h.close_connection = True

    @staticmethod
    def _reply(h: BaseHTTPRequestHandler, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        h.send_response(code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)
