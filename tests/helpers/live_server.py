"""A real edge server (edgeflow.serving.app.create_app under uvicorn) on a free 127.0.0.1 port, in a thread."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx

from tests.helpers.ports import free_port


class LiveServer:
    """uvicorn serving create_app(...) in a daemon thread, like `python -m edgeflow.serving.server` does."""

    def __init__(self, engine_dir: Path, **settings) -> None:
        import uvicorn

        from edgeflow.serving.app import ServerSettings, create_app
        from edgeflow.serving.settings import uvicorn_config

        self.settings = ServerSettings(**settings)
        self.app = create_app(engine_dir, self.settings)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn_config(self.app, "127.0.0.1", self.port, lifespan="on")  # what `python -m edgeflow.serving.server` runs
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        from edgeflow.serving.auth import load_keys

        key = self.settings.api_key
        keys = sorted(load_keys(key.get_secret_value() if key else None, self.settings.api_key_file))
        self.headers = {"Authorization": f"Bearer {keys[0]}"} if keys else {}

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/ready", timeout=2, headers=self.headers).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"server on {self.url} did not become ready")

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
