"""The remote tier's URL (KVPOOL_REMOTE_URL): its schemes, the TLS options taken, a cluster's seeds.

Stdlib only: the settings check a URL with it at start (service/config.py) without importing the tier
(redis-py) or making the settings depend on the tiers, which are built from them.
"""

import urllib.parse
from typing import Any

SCHEMES = ("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://")
# The ssl_* URL options (redis-py's names and defaults) both read paths take on rediss:// URLs.
TLS_OPTIONS = ("ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname")
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
Address = tuple[str, int]


def is_cluster_url(url: str) -> bool:
    return url.split("://", 1)[0] in CLUSTER_SCHEMES


def parse_cluster_url(url: str) -> tuple[list[Address], str | None, str | None, dict[str, Any] | None]:
    """(seed addresses, username, password, TLS options or None without TLS) of a redis+cluster:// URL;
    ValueError if malformed."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in CLUSTER_SCHEMES:
        raise ValueError(f"not a Redis Cluster URL: {parts.scheme}://")
    if parts.path not in ("", "/", "/0"):
        raise ValueError("a Redis Cluster has only database 0")
    options: dict[str, Any] = dict(urllib.parse.parse_qsl(parts.query))
    if set(options) - set(TLS_OPTIONS) or (options and parts.scheme != "rediss+cluster"):
        raise ValueError(f"a Redis Cluster URL takes no options but {', '.join(TLS_OPTIONS)} (rediss+cluster://)")
    if "ssl_check_hostname" in options:
        options["ssl_check_hostname"] = options["ssl_check_hostname"].lower() in ("true", "1", "yes")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    username, _, password = userinfo.partition(":")
    seeds = []
    for item in hosts.split(","):
        if item.startswith("["):  # [IPv6]:port
            host, _, port = item[1:].partition("]")
            port = port.removeprefix(":")
        else:
            host, _, port = item.partition(":")
        if not host or (port and not port.isdigit()):
            raise ValueError(f"a Redis Cluster URL lists host:port seeds, not {item!r}")
        seeds.append((host, int(port or 6379)))
    unquote = urllib.parse.unquote
    tls = options if parts.scheme == "rediss+cluster" else None
    return seeds, unquote(username) or None, unquote(password) or None, tls
