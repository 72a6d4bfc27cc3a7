"""Parsing and validation of KVPOOL_API_KEYS and KVPOOL_IPC_TENANTS (service/tenancy.py, service/config.py)."""

import pytest
from pydantic import ValidationError

from service.config import Settings, describe_errors
from service.tenancy import parse_api_keys, parse_tenant_names

K1, K2, K3 = "k1-0123456789abcdef", "k2-0123456789abcdef", "k3-0123456789abcdef"


def test_keys_map_to_their_tenants() -> None:
    assert parse_api_keys("") == {} and parse_api_keys("  ") == {}
    assert parse_api_keys(f" alpha:{K1} , beta:{K2},alpha:{K3}") == {K1: "alpha", K2: "beta", K3: "alpha"}
    assert parse_api_keys("t:abc:def-0123456789") == {"abc:def-0123456789": "t"}  # split at the first colon
    assert parse_tenant_names(" a, b.c ,d_e-1") == {"a", "b.c", "d_e-1"}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (f"alpha{K1}", "entry 1 has no colon"),
        (f"alpha:{K1},{K2}", "entry 2 has no colon"),
        (f":{K1}", "entry 1: the tenant name must be 1-64 characters"),
        (f"al pha:{K1}", "entry 1: the tenant name must be"),
        (f"{K1}/+:alpha", "entry 1: the tenant name must be"),  # reversed, with a key that is no tenant name
        (f"{K1}:alpha", "entry 1: the key must be at least 16"),  # reversed
        ("alpha:", "entry 1: the key must be at least 16"),
        ("alpha:short", "the key must be at least 16"),
        ("alpha:0123456789abcdef ghij", "without spaces"),
        (f"alpha:{K1},,beta:{K2}", "entry 2 is empty"),
        (f"alpha:{K1},beta:{K1}", "entry 2 repeats the key of an earlier entry (tenant 'alpha')"),
    ],
)
def test_bad_api_keys_get_a_clear_message_that_never_shows_a_key(spec: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_api_keys(spec)
    assert message in str(info.value)
    with pytest.raises(ValidationError) as settings_info:
        Settings(api_keys=spec)
    text = describe_errors(settings_info.value)
    assert text.startswith("KVPOOL_API_KEYS: ") and message in text
    for key in (K1, K2, "short", "0123456789abcdef ghij"):
        assert key not in text


def test_keys_stay_out_of_the_settings_repr() -> None:
    settings = Settings(api_keys=f"alpha:{K1}", ipc_tenants="alpha")
    assert K1 not in repr(settings) and K1 not in str(settings.model_dump())
    assert settings.api_key_tenants == {K1: "alpha"} and settings.ipc_tenant_names == {"alpha"}
    assert Settings().api_key_tenants == {}
