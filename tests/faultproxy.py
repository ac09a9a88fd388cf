"""A loopback HTTP proxy in front of a GCS emulator that makes a share of requests fail, for tests of a flaky store.

Each request, with probability `fail_rate` (or always while `down`), gets one fault picked from `kinds`:
  "503"   answer 503 with a GCS-style JSON error, without forwarding (gcsfs retries it);
  "403"   the same with 403 (gcsfs raises OSError("Forbidden ...") at once, no retry);
  "reset" read the request, then drop the connection with an RST and no response (gcsfs retries it);
  "delay" sleep `delay_s`, then forward normally (slow, not failed).
While `down`, only the failing kinds in `kinds` are used ("503" when there are none). With `down_after`, the proxy
goes down by itself once it has forwarded a request that names that object (in its URL or an upload's metadata):
"the store went away right after this file reached it", at the same point of a run on any machine. With `hold`, a
request naming that object waits until `release` is set (`held` is set once one waits): a read the test can
catch in flight.

    python tests/faultproxy.py --target http://127.0.0.1:9023 --fail-rate 0.2 [--port N]
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import random
import socket
import struct
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

# Per-connection headers that must not be relayed (RFC 9110 7.6.1); the body is always re-sent with Content-Length.
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "expect", "content-length"}
FAILING = ("503", "403", "reset")


class FaultProxy:
    def __init__(
        self,
        target: str,
        fail_rate: float = 0.0,
        seed: int = 0,
        delay_s: float = 0.5,
        kinds: tuple[str, ...] = ("503", "reset", "delay"),
        port: int = 0,
        down_after: str | None = None,
        hold: str | None = None,
    ) -> None:
        unknown = set(kinds) - {*FAILING, "delay"}
        assert kinds and not unknown, f"unknown fault kinds {unknown}"
        parts = urlsplit(target)
        self.target = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.fail_rate, self.delay_s, self.kinds, self.port = fail_rate, delay_s, tuple(kinds), port
        self.down = False
        self.down_after = down_after
        self.hold, self.held, self.release = hold, threading.Event(), threading.Event()
        self.counts = {"requests": 0, **{k: 0 for k in (*FAILING, "delay")}}
        self.url = ""
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._server: _Server | None = None
        self._conns: set[socket.socket] = set()  # open client connections, closed by stop()

    def _pick(self) -> str | None:
        """The fault for one request (None: forward it untouched), counted."""
        with self._lock:
            self.counts["requests"] += 1
            if self.down:
                kind = self._rng.choice([k for k in self.kinds if k in FAILING] or ["503"])
            elif self._rng.random() < self.fail_rate:
                kind = self._rng.choice(self.kinds)
            else:
                return None
            self.counts[kind] += 1
            return kind

    def start(self) -> FaultProxy:
        self._server = _Server(self)
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._server.serve_forever, name="faultproxy", daemon=True).start()
        return self

    def stop(self) -> None:
        self.release.set()
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self._server = None
        for conn in list(self._conns):  # kept-alive connections would otherwise go on being served by their threads
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, proxy: FaultProxy) -> None:
        self.proxy = proxy
        super().__init__(("127.0.0.1", proxy.port), _Handler)

    def finish_request(self, request, client_address) -> None:
        self.proxy._conns.add(request)
        try:
            super().finish_request(request, client_address)
        finally:
            self.proxy._conns.discard(request)

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a client that hangs up early is no news
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive toward the client; every response carries Content-Length
    server: _Server

    def log_message(self, format, *args) -> None:  # quiet
        pass

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            body = b""
            while size := int(self.rfile.readline().split(b";")[0].strip(), 16):
                body += self.rfile.read(size)
                self.rfile.readline()  # the CRLF after each chunk
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers, up to the blank line
                pass
            return body
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _forward(self, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        # Host stays as the client sent it, so the emulator's resumable-upload Location URLs point back here.
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP and k.lower()[:6] != "proxy-"}
        if body or self.command in ("POST", "PUT", "PATCH"):
            headers["Content-Length"] = str(len(body))
        upstream = http.client.HTTPConnection(*self.server.proxy.target, timeout=120)
        try:
            upstream.request(self.command, self.path, body=body or None, headers=headers)
            resp = upstream.getresponse()
            data = resp.read()
            # A HEAD answer's Content-Length describes the GET's body: relay it as is; others get len(data) below.
            keep = HOP_BY_HOP - ({"content-length"} if self.command == "HEAD" else set())
            return resp.status, [(k, v) for k, v in resp.getheaders() if k.lower() not in keep], data
        except (OSError, http.client.HTTPException) as e:  # the store itself is unreachable: a gateway error
            return 502, [("Content-Type", "text/plain")], f"faultproxy: upstream failed: {e!r}".encode()
        finally:
            upstream.close()

    def _names(self, name: str, body: bytes) -> bool:
        """Whether this request is about object `name`: in its path or query, or in an upload's JSON metadata."""
        return name in unquote(self.path) or name.encode() in body[:8192]

    def _handle(self) -> None:
        body = self._read_body()
        if self.server.proxy.hold and self._names(self.server.proxy.hold, body):
            self.server.proxy.held.set()
            self.server.proxy.release.wait()
        kind = self.server.proxy._pick()
        if kind == "reset":
            # SO_LINGER with a zero timeout makes close() send RST instead of FIN: a connection reset by the peer.
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
            self.close_connection = True  # the socket really closes (and resets) once the handler lets go of it
            return
        if kind in ("503", "403"):
            error = json.dumps({"error": {"code": int(kind), "message": "injected fault"}}).encode()
            status, headers, data = int(kind), [("Content-Type", "application/json")], error
        else:
            if kind == "delay":
                time.sleep(self.server.proxy.delay_s)
            status, headers, data = self._forward(body)
            if self.server.proxy.down_after and status < 300 and self._names(self.server.proxy.down_after, body):
                self.server.proxy.down = True
        self.send_response_only(status)
        for name, value in headers:
            self.send_header(name, value)
        if self.command != "HEAD" and status >= 200 and status not in (204, 304):
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)  # empty for HEAD (http.client reads no body for it)

    do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = _handle


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="the store's URL, e.g. http://127.0.0.1:9023")
    parser.add_argument("--fail-rate", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--delay-s", type=float, default=0.5)
    parser.add_argument("--kinds", default="503,reset,delay", help="comma-separated: 503, 403, reset, delay")
    parser.add_argument("--port", type=int, default=0)
    a = parser.parse_args()
    with FaultProxy(a.target, a.fail_rate, a.seed, a.delay_s, tuple(a.kinds.split(",")), a.port) as proxy:
        print(proxy.url, flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            threading.Event().wait()
