"""Helpers for the HTTP lease API tests: a real Redis server (never the shared one on 6379) and a
real uvicorn server running the broker on a free loopback port, in a thread of the test
process."""

from __future__ import annotations

import threading
import time

import httpx
from gpulock_broker import create_broker_app, parse_tokens

from support.ports import free_port

USER_TOKEN = "user-token-0123456789abcdef"
OTHER_TOKEN = "other-token-0123456789abcdef"
ADMIN_TOKEN = "admin-token-0123456789abcdef"
LIMITED_TOKEN = "limited-token-0123456789abcdef"

TOKENS = {
    "tokens": [
        {"name": "user", "token": USER_TOKEN, "pools": ["*"]},
        {"name": "other", "token": OTHER_TOKEN, "pools": ["*"]},
        {"name": "admin", "token": ADMIN_TOKEN, "pools": ["*"], "admin": True},
        {"name": "limited", "token": LIMITED_TOKEN, "pools": ["gpu-a"]},
    ]
}


class BrokerServer:
    """uvicorn serving create_broker_app() on a thread; ``url``, ``stop()``."""

    def __init__(self, redis_url: str, host: str = "127.0.0.1", **broker_kw):
        import uvicorn

        self.port = free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.app = create_broker_app(redis_url, parse_tokens(TOKENS, "test"), **broker_kw)
        self.server = uvicorn.Server(
            uvicorn.Config(
                self.app,
                host=host,
                port=self.port,
                log_level="warning",
                access_log=False,
                lifespan="on",
            )
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> "BrokerServer":
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("broker did not start")
            time.sleep(0.02)
        return self

    @property
    def broker(self):
        return self.app.state.gpulock_broker

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def client(url: str, token: str | None = USER_TOKEN, **kw) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=url, headers=headers, timeout=30, **kw)
