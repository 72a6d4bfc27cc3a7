"""Parsing of the tenant settings: KVPOOL_API_KEYS="tenant:key,..." and KVPOOL_IPC_TENANTS="a,b".

Pure (re only), so that config.py can validate at start and auth.py can use the result.
"""

import re

TENANT_PATTERN = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
MIN_KEY_LENGTH = 16
TENANT_RULE = "1-64 characters of A-Z a-z 0-9 . _ -"


def parse_api_keys(spec: str) -> dict[str, str]:
    """ "tenant:key,tenant:key" -> {key: tenant}.

    A tenant may have several keys (rotation); a key may name only one tenant. Messages never repeat a key.
    """
    keys: dict[str, str] = {}
    if not spec.strip():
        return keys
    for number, raw in enumerate(spec.split(","), start=1):
        entry = raw.strip()
        if not entry:
            raise ValueError(f"entry {number} is empty (expected tenant:key,tenant:key,...)")
        tenant, colon, key = entry.partition(":")
        tenant, key = tenant.strip(), key.strip()
        if not colon:
            raise ValueError(f"entry {number} has no colon (expected tenant:key)")
        # Neither part is repeated in a message: a reversed entry (key:tenant) would show its key.
        if not TENANT_PATTERN.match(tenant):
            raise ValueError(f"entry {number}: the tenant name must be {TENANT_RULE}")
        if len(key) < MIN_KEY_LENGTH or not key.isascii() or not key.isprintable() or " " in key:
            raise ValueError(
                f"entry {number}: the key must be at least {MIN_KEY_LENGTH} printable ASCII "
                "characters without spaces (make one with: python -c 'import secrets; print(secrets.token_urlsafe())')"
            )
        if key in keys:
            raise ValueError(f"entry {number} repeats the key of an earlier entry (tenant {keys[key]!r})")
        keys[key] = tenant
    return keys


def parse_tenant_names(spec: str) -> frozenset[str]:
    """ "a, b" -> {"a", "b"}."""
    names = [n.strip() for n in spec.split(",")] if spec.strip() else []
    for name in names:
        if not TENANT_PATTERN.match(name):
            raise ValueError(f"tenant name {name!r} must be {TENANT_RULE}")
    return frozenset(names)
