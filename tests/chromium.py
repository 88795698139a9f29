"""Headless Chromium for the tests that render batchgen's HTML report: load a page, collect what it reports as an
error (console.error, uncaught exceptions, failed resource loads), evaluate an expression in it, and optionally take
a full-page PNG screenshot. It speaks the Chrome DevTools Protocol over `--remote-debugging-pipe` (fd 3: commands
to the browser, fd 4: messages from it, each JSON ended by a NUL byte) rather than over a websocket, so it needs
only the standard library: no websocket client, no port to pick, nothing listening."""
from __future__ import annotations

import base64
import fcntl
import json
import math
import os
import queue
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-sync",
         "--disable-background-networking", "--disable-component-update", "--remote-debugging-pipe"]


def available() -> bool:
    """Whether the chromium binary exists and runs."""
    try:
        return subprocess.run([CHROMIUM, "--version"], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@dataclass
class PageCheck:
    console_errors: list[str]  # console.error/assert, uncaught exceptions, Log entries of level "error"
    value: Any  # the result of the `evaluate` expression, run after the load event
    screenshot: bytes | None  # PNG of the full page, when asked for


class _Browser:
    """A headless Chromium in its own process group, and its DevTools pipe; every wait ends by the deadline."""

    def __init__(self, timeout_s: float):
        self.deadline = time.monotonic() + timeout_s
        self.profile, self.log = tempfile.mkdtemp(prefix="chromium-profile-"), tempfile.TemporaryFile()
        self.ids, self.events, self.messages = 0, [], queue.Queue()
        (cmd_r, self.cmd_w), (self.msg_r, msg_w) = os.pipe(), os.pipe()
        # The child's ends go to fds >= 5, so that dup2 onto 3 and 4 cannot clobber one with the other. Not pass_fds:
        # it would close the 3 and 4 that preexec_fn makes; and close_fds=False is safe as our fds are close-on-exec.
        child = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 5) for fd in (cmd_r, msg_w)]
        try:
            self.proc = subprocess.Popen(
                [CHROMIUM, *FLAGS, f"--user-data-dir={self.profile}", "about:blank"], stdin=subprocess.DEVNULL,
                stdout=self.log, stderr=self.log, close_fds=False, start_new_session=True,
                preexec_fn=lambda: (os.dup2(child[0], 3), os.dup2(child[1], 4)))
        except BaseException:
            os.close(self.cmd_w), os.close(self.msg_r), self.log.close(), shutil.rmtree(self.profile)
            raise
        finally:
            for fd in (cmd_r, msg_w, *child):
                os.close(fd)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        buf = b""
        while chunk := os.read(self.msg_r, 1 << 20):
            *done, buf = (buf + chunk).split(b"\0")
            for text in done:
                self.messages.put(json.loads(text))
        os.close(self.msg_r)
        self.messages.put(None)  # the browser (and all that inherited fd 4) is gone

    def _next(self, step: str, until: float = math.inf) -> dict | None:
        """The next message (events are also kept in self.events); None if `until` comes first."""
        try:
            message = self.messages.get(timeout=max(0, min(until, self.deadline) - time.monotonic()))
        except queue.Empty:
            if until < self.deadline:
                return None
            raise TimeoutError(f"chromium: timed out waiting for {step}{self.stderr_tail()}") from None
        if message is None:
            raise RuntimeError(f"chromium exited while waiting for {step}{self.stderr_tail()}")
        if "method" in message:
            self.events.append(message)
        return message

    def send(self, method: str, session: str | None = None, **params) -> dict:
        self.ids += 1
        command = {"id": self.ids, "method": method, "params": params, **({"sessionId": session} if session else {})}
        os.write(self.cmd_w, json.dumps(command).encode() + b"\0")
        while (message := self._next(method)).get("id") != self.ids:
            pass
        if "error" in message:
            raise RuntimeError(f"chromium: {method} failed: {message['error']}")
        return message["result"]

    def wait_event(self, method: str, since: int) -> None:
        while not any(e["method"] == method for e in self.events[since:]):
            self._next(method)

    def stderr_tail(self) -> str:
        self.log.seek(0)
        return "\nchromium stderr (tail):\n" + self.log.read().decode(errors="replace")[-3000:]

    def close(self) -> None:
        try:
            os.write(self.cmd_w, json.dumps({"id": 0, "method": "Browser.close"}).encode() + b"\0")
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            pass
        try:  # whatever is left of the group: renderer, GPU and zygote processes
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        os.close(self.cmd_w), self.log.close(), shutil.rmtree(self.profile, ignore_errors=True)


def _error_text(event: dict) -> str | None:
    method, p = event["method"], event.get("params", {})
    if method == "Runtime.consoleAPICalled" and p["type"] in ("error", "assert"):
        where = ((p.get("stackTrace") or {}).get("callFrames") or [{}])[0]
        text = f"console.{p['type']}: " + " ".join(
            str(a.get("value", a.get("description", a["type"]))) for a in p.get("args", []))
    elif method == "Runtime.exceptionThrown":
        where = p["exceptionDetails"]
        text = "exception: " + ((where.get("exception") or {}).get("description") or where.get("text", ""))
    elif method == "Log.entryAdded" and p["entry"]["level"] == "error":
        where = p["entry"]
        text = f"{where['source']}: {where['text']}"
    else:
        return None
    url, line = where.get("url"), where.get("lineNumber")
    return text + (f" ({url}:{line + 1})" if url and line is not None else f" ({url})" if url else "")


def check_page(path_or_url: str, evaluate: str = "null", screenshot: bool = False, width: int = 1280,
               timeout_s: float = 60) -> PageCheck:
    """Load a page (a local path or a URL) in a fresh headless Chromium; see PageCheck for what comes back."""
    is_url = "://" in path_or_url or path_or_url.startswith(("about:", "data:"))
    url = path_or_url if is_url else Path(path_or_url).resolve().as_uri()
    browser = _Browser(timeout_s)
    try:
        pages = [t for t in browser.send("Target.getTargets")["targetInfos"] if t["type"] == "page"]
        target = pages[0]["targetId"] if pages else browser.send("Target.createTarget", url="about:blank")["targetId"]
        session = browser.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for method in ("Runtime.enable", "Log.enable", "Page.enable"):
            browser.send(method, session)
        browser.send("Emulation.setDeviceMetricsOverride", session, width=width, height=800, deviceScaleFactor=1,
                     mobile=False)
        since = len(browser.events)
        navigated = browser.send("Page.navigate", session, url=url)
        if "errorText" in navigated:
            raise RuntimeError(f"chromium: navigating to {url} failed: {navigated['errorText']}")
        browser.wait_event("Page.loadEventFired", since)
        late = time.monotonic() + 0.3  # errors that come just after the load event
        while browser._next("late messages", late) is not None:
            pass
        result = browser.send("Runtime.evaluate", session, expression=evaluate, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            d = result["exceptionDetails"]
            raise AssertionError(f"evaluating {evaluate!r} threw: "
                                 f"{(d.get('exception') or {}).get('description') or d.get('text')}")
        png = None
        if screenshot:
            metrics = browser.send("Page.getLayoutMetrics", session)
            height = math.ceil((metrics.get("cssContentSize") or metrics["contentSize"])["height"])
            png = base64.b64decode(browser.send(
                "Page.captureScreenshot", session, format="png", captureBeyondViewport=True,
                clip={"x": 0, "y": 0, "width": width, "height": height, "scale": 1})["data"])
        errors = [text for e in browser.events[since:] if e.get("sessionId") == session and (text := _error_text(e))]
        return PageCheck(console_errors=errors, value=result["result"].get("value"), screenshot=png)
    finally:
        browser.close()
