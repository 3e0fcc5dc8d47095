"""A real browser for the tests: Debian's headless Chromium driven over the Chrome DevTools
Protocol on a pipe (`--remote-debugging-pipe`: the browser reads commands on its fd 3 and
writes replies and events on its fd 4, each a JSON object ended by a NUL byte), so no
websocket client or browser-automation package is needed.

    with Browser(tmp_path) as browser:        # pytest.skip when chromium is not installed
        page = browser.open("http://127.0.0.1:8765/")
        page.evaluate("document.title")
        page.screenshot(tmp_path / "page.png")

`evaluate` returns the expression's value (JSON-able values only); an exception in the
page's own scripts is kept in `page.errors` for the test to check.
"""
from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

__all__ = ["Browser", "Page", "find_chromium"]

CANDIDATES = ("chromium", "chromium-browser", "/usr/bin/chromium")
REPLY_TIMEOUT = 60.0


def find_chromium() -> str | None:
    for name in CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


def _above_9(fd: int) -> int:
    """`fd` moved to the lowest free descriptor above 9 (the original closed)."""
    import fcntl

    moved = fcntl.fcntl(fd, fcntl.F_DUPFD, 10)
    os.close(fd)
    return moved


class BrowserError(RuntimeError):
    pass


class Browser:
    def __init__(self, tmp_path: Path, width: int = 1400, height: int = 1000):
        exe = find_chromium()
        if exe is None:
            pytest.skip("chromium is not installed (Debian package chromium): the dashboard's "
                        "browser tests need it")
        self.tmp = Path(tmp_path)
        self.width, self.height = width, height
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        # the browser's ends moved above 9: one that was fd 3 or 4 itself (a process with
        # few files open) would be closed by the redirects below after becoming 3 or 4
        to_browser_r, from_browser_w = (_above_9(fd) for fd in (to_browser_r, from_browser_w))
        args = ["--headless", "--remote-debugging-pipe", "--disable-gpu", "--no-first-run",
                "--no-default-browser-check", "--disable-extensions", "--mute-audio",
                "--disable-background-networking", "--disable-component-update",
                "--disable-dev-shm-usage", f"--window-size={width},{height}",
                f"--user-data-dir={self.tmp / 'chromium-profile'}", "about:blank"]
        if os.geteuid() == 0:
            args.insert(0, "--no-sandbox")       # Chromium refuses to run as root otherwise
        # the pipe's ends become the browser's fds 3 and 4 (bash: any fd number in a redirect)
        script = (f'exec "$@" 3<&{to_browser_r} 4>&{from_browser_w} '
                  f'{to_browser_r}<&- {from_browser_w}>&-')
        self.log_path = self.tmp / "chromium.log"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(["bash", "-c", script, "chromium", exe, *args],
                                         pass_fds=(to_browser_r, from_browser_w),
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._next_id = 0
        self._replies: dict[int, dict] = {}
        self._events: list[dict] = []
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()
        self._closed = False
        self._reader = threading.Thread(target=self._read, name="cdp-reader", daemon=True)
        self._reader.start()

    # ------------------------------------------------------------------ protocol
    def _read(self) -> None:
        buffer = b""
        while True:
            try:
                chunk = os.read(self._from_browser, 1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                with self._cond:
                    self._closed = True
                    self._cond.notify_all()
                return
            buffer += chunk
            while b"\0" in buffer:
                raw, buffer = buffer.split(b"\0", 1)
                message = json.loads(raw)
                with self._cond:
                    if "id" in message:
                        self._replies[message["id"]] = message
                    else:
                        self._events.append(message)
                    self._cond.notify_all()

    def send(self, method: str, params: dict | None = None, session: str | None = None,
             timeout: float = REPLY_TIMEOUT) -> dict:
        with self._send_lock:
            self._next_id += 1
            call = {"id": self._next_id, "method": method, "params": params or {}}
            if session is not None:
                call["sessionId"] = session
            os.write(self._to_browser, json.dumps(call).encode() + b"\0")
        with self._cond:
            if not self._cond.wait_for(lambda: call["id"] in self._replies or self._closed,
                                       timeout):
                raise BrowserError(f"no reply to {method} within {timeout:g} s")
            if call["id"] not in self._replies:
                raise BrowserError(f"the browser exited during {method}: {self.log_tail()}")
            reply = self._replies.pop(call["id"])
        if "error" in reply:
            raise BrowserError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def events(self, method: str, session: str | None = None) -> list[dict]:
        with self._cond:
            return [e for e in self._events if e.get("method") == method
                    and (session is None or e.get("sessionId") == session)]

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    # ------------------------------------------------------------------ pages
    def open(self, url: str) -> "Page":
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target,
                                                      "flatten": True})["sessionId"]
        page = Page(self, session)
        page.call("Runtime.enable")
        page.call("Page.enable")
        page.call("Emulation.setDeviceMetricsOverride",
                  {"width": self.width, "height": self.height, "deviceScaleFactor": 1,
                   "mobile": False})
        result = page.call("Page.navigate", {"url": url})
        if result.get("errorText"):
            raise BrowserError(f"cannot open {url}: {result['errorText']}")
        return page

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("Browser.close", timeout=10)
            except (BrowserError, OSError):
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for fd in (self._to_browser, self._from_browser):
            try:
                os.close(fd)
            except OSError:
                pass

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Page:
    def __init__(self, browser: Browser, session: str):
        self.browser, self.session = browser, session

    def call(self, method: str, params: dict | None = None) -> dict:
        return self.browser.send(method, params, session=self.session)

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", {"expression": expression,
                                                "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression[:80]!r} raised: "
                               f"{result['exceptionDetails'].get('text')} "
                               f"{result['exceptionDetails'].get('exception', {})}")
        return result["result"].get("value")

    @property
    def errors(self) -> list[str]:
        """Uncaught exceptions of the page's scripts, as text."""
        return [json.dumps(e["params"]["exceptionDetails"])[:500]
                for e in self.browser.events("Runtime.exceptionThrown", self.session)]

    def screenshot(self, path: Path) -> Path:
        """The whole page (beyond the viewport) as a PNG file."""
        data = self.call("Page.captureScreenshot", {"format": "png",
                                                    "captureBeyondViewport": True})["data"]
        path = Path(path)
        path.write_bytes(base64.b64decode(data))
        return path
