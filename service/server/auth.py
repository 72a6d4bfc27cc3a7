"""API keys and tenants.

With KVPOOL_API_KEYS set, every /v1/* request needs `Authorization: Bearer <key>`; the key's tenant
becomes `request.state.tenant` (read by service.server.state.get_tenant), which scopes sequence ids, prefix
hashes and page quotas in the core. /healthz, /readyz, /metrics, /docs and /openapi.json stay open.
With no keys, auth is off and every caller is the one tenant "".
"""

import hashlib
import hmac
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from service.config import Settings
from service.core.errors import Forbidden, Unauthorized
from service.server.errors import error_response
from service.server.state import StateDep, TenantDep
from service.wire.errors import status_of


def is_protected(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


class ApiKeys:
    """{key: tenant}, looked up in constant time per key."""

    def __init__(self, keys: dict[str, str]) -> None:
        # Digests have one length, so compare_digest runs in constant time whatever the key's length.
        self._digests = [(hashlib.sha256(key.encode()).digest(), tenant) for key, tenant in keys.items()]

    def tenant_of(self, key: str) -> str | None:
        """The tenant of `key`, comparing against every configured key (no early exit)."""
        digest = hashlib.sha256(key.encode()).digest()
        found = None
        for known, tenant in self._digests:
            if hmac.compare_digest(digest, known):
                found = tenant
        return found


class BearerAuth:
    """Pure ASGI middleware: rejects a protected request with 401 before its body is read."""

    def __init__(self, app: ASGIApp, keys: dict[str, str]) -> None:
        self.app = app
        self.tenant_of = ApiKeys(keys).tenant_of

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_protected(scope["path"]):
            await self.app(scope, receive, send)
            return
        header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        scheme, _, key = (header or b"").decode("latin-1").strip().partition(" ")
        if header is None:
            problem, challenge = "missing Authorization: Bearer <key> header", 'Bearer realm="kvpool"'
        elif scheme.lower() != "bearer" or not key.strip():
            problem, challenge = "the Authorization header must be: Bearer <key>", 'Bearer realm="kvpool"'
        else:
            tenant = self.tenant_of(key.strip())
            if tenant is not None:
                scope.setdefault("state", {})["tenant"] = tenant
                await self.app(scope, receive, send)
                return
            problem, challenge = "invalid API key", 'Bearer realm="kvpool", error="invalid_token"'
        response = error_response(status_of("unauthorized"), "unauthorized", problem, {"WWW-Authenticate": challenge})
        await response(scope, receive, send)


async def require_ipc_tenant(pool: StateDep, tenant: TenantDep) -> None:
    """The guard of GET /v1/ipc (see check_ipc_tenant)."""
    check_ipc_tenant(pool.settings, tenant)


def check_ipc_tenant(settings: Settings, tenant: str) -> None:
    """The one rule for the pool's IPC handles and descriptors: they map
    the whole pool, every tenant's pages included, so only tenants named in KVPOOL_IPC_TENANTS get them
    (403 `forbidden` for the others; with keys on and no KVPOOL_IPC_TENANTS, nobody does).

    With API keys off there are no tenants to tell apart: the server is single-tenant and trusts
    whoever can reach it, so IPC is allowed (the settings refuse KVPOOL_IPC_TENANTS without keys).
    """
    if not settings.api_keys.get_secret_value():
        return
    if tenant not in settings.ipc_tenant_names:
        raise Forbidden(
            f"tenant {tenant!r} may not fetch the pool's IPC handles: it maps every tenant's pages "
            "(allowed tenants are listed in KVPOOL_IPC_TENANTS)"
        )


def ipc_authorizer(settings: Settings) -> Callable[[str | None], None]:
    """authorize(api_key) for the pool's Unix socket: the key as `Authorization: Bearer` would be checked
    (401 `unauthorized`), then check_ipc_tenant (403 `forbidden`)."""
    keys = ApiKeys(settings.api_key_tenants)

    def authorize(api_key: str | None) -> None:
        if not settings.api_keys.get_secret_value():
            return
        if not api_key:
            raise Unauthorized("the pool's descriptors need an API key (KVPOOL_API_KEYS is set)")
        tenant = keys.tenant_of(api_key.strip())
        if tenant is None:
            raise Unauthorized("invalid API key")
        check_ipc_tenant(settings, tenant)

    return authorize
