"""Who may fetch GET /v1/ipc (the whole pool): the tenants in KVPOOL_IPC_TENANTS (in process,
behind the real auth middleware of create_app()); the memfd socket the route names follows the same rule."""

import os
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from service.config import Settings
from service.core.errors import Forbidden, Unauthorized
from service.ipc.fd_socket import receive_fds
from service.server.app import create_app

GEOMETRY = dict(num_layers=1, num_kv_heads=1, head_dim=8, page_size=4, num_pages=4, device="cpu")
A, B, C = "alpha-key-7f3c9b2e41d0", "beta-key-0c8e5a1f93b7", "gamma-key-3e9d0b7a52c1"


@pytest.fixture
def client() -> Iterator[TestClient]:
    settings = Settings(api_keys=f"alpha:{A},beta:{B},gamma:{C}", ipc_tenants="alpha, gamma", **GEOMETRY)
    with TestClient(create_app(settings)) as c:
        yield c


def test_only_the_ipc_tenants_get_through(client: TestClient) -> None:
    for key in (A, C):
        r = client.get("/v1/ipc", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200 and r.json()["kind"] == "memfd"
        answer, fds = receive_fds(r.json()["socket"], key)
        assert answer["keys"] == ["blocks"] and len(fds) == 1
        os.close(fds[0])
    r = client.get("/v1/ipc", headers={"Authorization": f"Bearer {B}"})
    assert r.status_code == 403
    assert r.json()["error"]["code"] == "forbidden" and "KVPOOL_IPC_TENANTS" in r.json()["error"]["message"]
    assert client.get("/v1/ipc").status_code == 401
    path = client.get("/v1/ipc", headers={"Authorization": f"Bearer {A}"}).json()["socket"]
    with pytest.raises(Forbidden, match="KVPOOL_IPC_TENANTS"):
        receive_fds(path, B)
    with pytest.raises(Unauthorized):
        receive_fds(path, None)


def test_with_keys_and_no_ipc_tenants_nobody_gets_through() -> None:
    app = create_app(Settings(api_keys=f"alpha:{A}", **GEOMETRY))
    with TestClient(app) as c:
        r = c.get("/v1/ipc", headers={"Authorization": f"Bearer {A}"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"


def test_with_api_keys_off_the_single_tenant_gets_through() -> None:
    with TestClient(create_app(Settings(**GEOMETRY))) as c:
        path = c.get("/v1/ipc").json()["socket"]
        _, fds = receive_fds(path, None)
        assert len(fds) == 1
        os.close(fds[0])
    assert not os.path.exists(path) and not os.path.exists(os.path.dirname(path))  # removed at shutdown


def test_ipc_tenants_must_have_keys() -> None:
    with pytest.raises(ValueError, match="KVPOOL_API_KEYS is empty"):
        Settings(ipc_tenants="alpha", **GEOMETRY)
    with pytest.raises(ValueError, match=r"names \['beta'\], which have no key"):
        Settings(api_keys=f"alpha:{A}", ipc_tenants="alpha,beta", **GEOMETRY)
