"""Drive headless Chromium over the DevTools protocol (no extra dependency: tornado's
websocket client, which Dask already needs)."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

CHROMIUM = os.environ.get("DIGENRL_CHROMIUM") or shutil.which("chromium") or shutil.which(
    "chromium-browser") or shutil.which("google-chrome")
INSTALL_HINT = ("headless Chromium not found: install Debian's chromium package "
                "(apt-get install -y chromium) or set DIGENRL_CHROMIUM to a Chrome binary")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--remote-debugging-port=0", "--window-size=1400,1100"]


class Browser:
    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="digenrl-chromium-")
        self.proc = subprocess.Popen([CHROMIUM, *FLAGS, f"--user-data-dir={self.dir}",
                                      "about:blank"], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        port_file = Path(self.dir) / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text().strip()):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("chromium did not open its DevTools port")
            time.sleep(0.1)
        self.port = int(port_file.read_text().split()[0])

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def page_ws(self) -> str:
        from urllib.request import urlopen

        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            targets = json.loads(urlopen(f"http://127.0.0.1:{self.port}/json").read())
            pages = [t for t in targets if t.get("type") == "page"]
            if pages:
                return pages[0]["webSocketDebuggerUrl"]
            time.sleep(0.1)
        raise RuntimeError("no page target in chromium")

    def visit(self, url: str, ready_js: str, timeout: float = 60) -> dict:
        """Open ``url``, wait until ``ready_js`` is truthy; return its value, the errors
        seen and a PNG screenshot."""
        return asyncio.run(self._visit(url, ready_js, timeout))

    async def _visit(self, url, ready_js, timeout):
        from tornado.websocket import websocket_connect

        ws = await websocket_connect(self.page_ws(), max_message_size=64 << 20)
        ids = itertools.count(1)
        errors: list[str] = []
        pending: dict[int, asyncio.Future] = {}

        async def reader():
            while True:
                msg = await ws.read_message()
                if msg is None:
                    return
                data = json.loads(msg)
                if "id" in data and data["id"] in pending:
                    pending.pop(data["id"]).set_result(data)
                elif data.get("method") == "Runtime.exceptionThrown":
                    d = data["params"]["exceptionDetails"]
                    errors.append(d.get("exception", {}).get("description") or d.get("text"))
                elif data.get("method") == "Runtime.consoleAPICalled" and \
                        data["params"]["type"] == "error":
                    errors.append(" ".join(str(a.get("value", a.get("description")))
                                           for a in data["params"]["args"]))
                elif data.get("method") == "Log.entryAdded" and \
                        data["params"]["entry"]["level"] == "error":
                    entry = data["params"]["entry"]
                    if "favicon" not in entry.get("url", ""):
                        errors.append(entry["text"])

        task = asyncio.ensure_future(reader())

        async def call(method, **params):
            i = next(ids)
            fut = asyncio.get_running_loop().create_future()
            pending[i] = fut
            ws.write_message(json.dumps({"id": i, "method": method, "params": params}))
            return (await asyncio.wait_for(fut, 30)).get("result", {})

        for domain in ("Runtime", "Log", "Page"):
            await call(f"{domain}.enable")
        await call("Page.navigate", url=url)
        deadline = time.monotonic() + timeout
        value = None
        while time.monotonic() < deadline:
            res = await call("Runtime.evaluate", expression=ready_js, returnByValue=True)
            value = res.get("result", {}).get("value")
            if value:
                break
            await asyncio.sleep(0.25)
        shot = await call("Page.captureScreenshot", format="png")
        ws.close()
        task.cancel()
        return {"value": value, "errors": errors, "png": base64.b64decode(shot["data"])}
