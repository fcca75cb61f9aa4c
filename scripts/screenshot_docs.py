"""Build the documentation site, serve it on 127.0.0.1 and take headless-browser screenshots of it.

    python scripts/screenshot_docs.py --out /tmp/docs-shots     # home, a strategy page, a search

Needs chromium (Debian: ``apt-get install chromium``) and the docs extra (``pip install -e ".[docs]"``).
Each shot is a PNG; the script fails if the browser does not write one. ``--site DIR`` serves a site
built already instead of building one.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import functools
import http.server
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# page path (under the site) -> file name
SHOTS = {"": "home.png", "guide/strategies/easgd/": "strategy-easgd.png"}
SEARCH = "slow network"  # typed into the search box for search.png


def browser() -> str | None:
    return next((b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)


def build(site: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(site)], cwd=ROOT, check=True
    )


@contextlib.contextmanager
def serve(site: Path):
    """The site over HTTP on 127.0.0.1 (search needs http, not file://); yields its base URL."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


class DevTools:
    """A headless chromium driven over the DevTools protocol (a websocket, written here on the standard
    library): pages load and their scripts (material's search worker) run in real time, unlike
    ``--screenshot``, whose virtual time stops before the search index is built."""

    def __init__(self, chrome: str, size: tuple[int, int] = (1280, 900)):
        self.profile = tempfile.mkdtemp(prefix="parambox-chrome-")
        self.proc = subprocess.Popen(
            [
                chrome,
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                f"--user-data-dir={self.profile}",
                f"--window-size={size[0]},{size[1]}",
                "--remote-debugging-port=0",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        port_file = Path(self.profile) / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text().count("\n") >= 1):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.close()
                raise RuntimeError("chromium did not start its DevTools endpoint")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        targets = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10).read())
        page = next(t for t in targets if t["type"] == "page")
        self.sock = _ws_connect(page["webSocketDebuggerUrl"])
        self.next_id = 0

    def call(self, method: str, **params):
        self.next_id += 1
        _ws_send(self.sock, json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(_ws_recv(self.sock))
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def open(self, url: str, settle_s: float = 1.5) -> None:
        self.call("Page.enable")
        self.call("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete'")
        time.sleep(settle_s)

    def evaluate(self, expression: str):
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 20.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                value = self.evaluate(expression)
            except RuntimeError as e:  # the page navigated while the expression ran: ask the new one
                if "navigated or closed" not in str(e) and "context" not in str(e):
                    raise
                value = None
            if value:
                return value
            time.sleep(0.2)
        raise RuntimeError(f"timed out waiting for {expression}")

    def screenshot(self, png: Path) -> None:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        png.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.sock.close()
        self.proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.profile, ignore_errors=True)


def _ws_connect(url: str) -> socket.socket:
    parts = urllib.parse.urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=30)
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(
        (
            f"GET {parts.path} HTTP/1.1\r\nHost: {parts.hostname}:{parts.port}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
        ).encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(1)
    if b" 101 " not in head.split(b"\r\n")[0]:
        raise RuntimeError(f"websocket handshake refused: {head[:80]!r}")
    return sock


def _ws_send(sock: socket.socket, text: str) -> None:
    payload, mask = text.encode(), os.urandom(4)
    n = len(payload)
    head = bytes([0x81]) + (
        bytes([0x80 | n])
        if n < 126
        else bytes([0x80 | 126]) + struct.pack(">H", n)
        if n < 65536
        else bytes([0x80 | 127]) + struct.pack(">Q", n)
    )
    sock.sendall(head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise RuntimeError("the browser closed the connection")
        buf += chunk
    return bytes(buf)


def _ws_recv(sock: socket.socket) -> str:
    message = b""
    while True:
        b0, b1 = _recv_exact(sock, 2)
        n = b1 & 0x7F
        if n == 126:
            n = struct.unpack(">H", _recv_exact(sock, 2))[0]
        elif n == 127:
            n = struct.unpack(">Q", _recv_exact(sock, 8))[0]
        data = _recv_exact(sock, n)  # a server's frames are not masked
        if b0 & 0x0F in (0x1, 0x0):
            message += data
            if b0 & 0x80:
                return message.decode()


def search(browser: DevTools, base: str, query: str) -> int:
    """Type ``query`` into the site's search box; the number of results material lists."""
    browser.open(base)
    browser.evaluate("document.querySelector('label[for=__search]').click()")
    browser.evaluate(
        "(() => { const q = document.querySelector('input[data-md-component=search-query]');"
        f" q.focus(); q.value = {json.dumps(query)}; q.dispatchEvent(new Event('input', {{bubbles: true}}));"
        " q.dispatchEvent(new KeyboardEvent('keyup', {bubbles: true})); })()"
    )
    return browser.wait_for("document.querySelectorAll('.md-search-result__item').length")


def take(out: Path, site: Path | None = None) -> dict[str, object]:
    """Screenshots of SHOTS and of a search for SEARCH; returns the PNGs and the search's result count."""
    chrome = browser()
    if chrome is None:
        raise RuntimeError("no chromium here: apt-get install chromium")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="parambox-site-") as tmp:
        if site is None:
            site = Path(tmp) / "site"
            build(site)
        with serve(site) as base:
            devtools = DevTools(chrome)
            try:
                pngs = []
                for page, name in SHOTS.items():
                    devtools.open(base + page)
                    devtools.screenshot(out / name)
                    pngs.append(out / name)
                results = search(devtools, base, SEARCH)
                devtools.screenshot(out / "search.png")
                pngs.append(out / "search.png")
            finally:
                devtools.close()
    return {"pngs": pngs, "search_results": results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/docs-shots", help="folder for the PNGs")
    parser.add_argument("--site", default=None, help="a built site to serve (default: build one)")
    args = parser.parse_args(argv)
    shots = take(Path(args.out), Path(args.site) if args.site else None)
    for png in shots["pngs"]:
        print(png)
    print(f"search for {SEARCH!r}: {shots['search_results']} results")
    return 0


if __name__ == "__main__":
    sys.exit(main())
