"""The secret on a vLLM server's weight path, as an ASGI middleware vLLM installs with `--middleware`.

A server that accepts weight pushes lets whoever reaches its port replace the model that samples the training data.
`topr-trl vllm-serve` binds 127.0.0.1 unless told otherwise; listening elsewhere it requires a secret (`SECRET_ENV`),
and this middleware refuses, with 401 and a log line naming the caller and the route (never the secret), every
request without it as `Authorization: Bearer <secret>`: the weight path, the dev-mode control routes (pause, reset,
collective_rpc) and generation alike. Only `/health` stays open, for the liveness checks of clients and load
balancers. vLLM's own `--api-key` guards only its /v1 routes, not the dev-mode ones the weight path uses.
"""

from __future__ import annotations

import hashlib
import os
import secrets

from . import SECRET_ENV, log_line


OPEN_ROUTES = ("/health",)


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode()).digest()


class WeightPathSecret:
    """ASGI middleware: with `SECRET_ENV` set and non-empty in the server's environment, every HTTP request but
    `OPEN_ROUTES` must carry the secret; without it, the middleware lets everything through."""

    def __init__(self, app) -> None:
        self.app = app
        secret = os.environ.get(SECRET_ENV, "")
        self.expected = _digest(secret) if secret else None

    def authorised(self, scope) -> bool:
        for key, value in scope.get("headers", []):
            if key == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and secrets.compare_digest(_digest(token), self.expected)
        return False

    async def __call__(self, scope, receive, send):
        if (
            self.expected is None
            or scope["type"] not in ("http", "websocket")
            or scope.get("method") == "OPTIONS"
            or scope["path"] in OPEN_ROUTES
            or self.authorised(scope)
        ):
            return await self.app(scope, receive, send)
        client = scope.get("client") or ("?", 0)
        log_line(
            f"refused {scope.get('method', 'websocket')} {scope['path']} from {client[0]}:{client[1]}: no valid "
            f"secret ({SECRET_ENV})"
        )
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        await send({"type": "http.response.start", "status": 401, "headers": [(b"content-type", b"application/json")]})
        body = b'{"error": "Unauthorized: this server requires its secret"}'
        await send({"type": "http.response.body", "body": body})
