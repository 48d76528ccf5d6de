"""The ops token rule and the Host allow-list, as plain objects."""

from __future__ import annotations

import pytest

from monitoring.access import HostAllowList, OpsAccess, check_exposure, host_name
from schemas.settings import SettingsError, is_loopback, is_wildcard

TOKEN = "ops-token-0123456789abcdef"


@pytest.mark.parametrize(
    ("value", "name"),
    [
        ("127.0.0.1:8080", "127.0.0.1"),
        ("LocalHost", "localhost"),
        ("[::1]:8090", "::1"),
        ("[::1]", "::1"),
        ("::1", "::1"),
        ("api.example.com:443", "api.example.com"),
        (" ops.example ", "ops.example"),
    ],
)
def test_host_names_drop_ports_brackets_and_case(value: str, name: str) -> None:
    assert host_name(value) == name


def test_loopback_and_wildcard_addresses() -> None:
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.1.2.3", "localhost", "::1", "[::1]"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "", "10.0.0.5", "api.example.com"))
    assert all(is_wildcard(h) for h in ("0.0.0.0", "::", "[::]", ""))
    assert not any(is_wildcard(h) for h in ("127.0.0.1", "10.0.0.5", "localhost"))


def test_the_default_allow_list_is_loopback_and_the_bind_address() -> None:
    hosts = HostAllowList((), "127.0.0.1")
    for host in ("127.0.0.1:8080", "localhost:8080", "[::1]:8080", "LOCALHOST"):
        assert hosts.allows(host), host
    for foreign in ("attacker.example:8080", "127.0.0.1.attacker.example", "", None, "10.0.0.5"):
        assert not hosts.allows(foreign), foreign
    bound = HostAllowList((), "10.0.0.5")
    assert bound.allows("10.0.0.5:8080")
    assert bound.allows("localhost")
    assert not bound.allows("10.0.0.6")


def test_a_wildcard_bind_answers_any_name_unless_a_list_is_given() -> None:
    assert HostAllowList((), "0.0.0.0").allows("api.example.com")
    listed = HostAllowList(("api.example.com", ".internal.example"), "0.0.0.0")
    assert listed.allows("api.example.com:443")
    assert listed.allows("internal.example")
    assert listed.allows("ops.internal.example")
    assert not listed.allows("localhost")  # an explicit list is the whole list
    assert not listed.allows("evilinternal.example")
    assert HostAllowList(("*",), "127.0.0.1").allows("anything.example")


def test_no_token_is_allowed_on_loopback_only() -> None:
    check_exposure(None, host="127.0.0.1", variable="SLUICE_X_HOST", service="x")
    check_exposure(TOKEN, host="0.0.0.0", variable="SLUICE_X_HOST", service="x")
    with pytest.raises(SettingsError, match=r"SLUICE_X_HOST='0\.0\.0\.0' .*set SLUICE_OPS_TOKEN"):
        check_exposure(None, host="0.0.0.0", variable="SLUICE_X_HOST", service="x")
    with pytest.raises(SettingsError, match="SLUICE_OPS_TOKEN"):
        OpsAccess(None, host="ops.example", variable="SLUICE_X_HOST", service="x")


def test_without_a_token_everything_is_allowed_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="monitoring.access"):
        access = OpsAccess(None, host="127.0.0.1", variable="SLUICE_X_HOST", service="x")
    assert [r.getMessage() for r in caplog.records] == [
        "x: ops endpoints are open to anyone on this machine (127.0.0.1 is loopback and SLUICE_OPS_TOKEN is unset)"
    ]
    assert not access.required
    assert access.allows(None)
    assert access.allows_session(None)


def test_with_a_token_only_the_bearer_or_the_session_passes() -> None:
    access = OpsAccess(TOKEN, host="127.0.0.1", variable="SLUICE_X_HOST", service="x")
    assert access.required
    assert access.allows(f"Bearer {TOKEN}")
    assert access.allows(f"bearer  {TOKEN} ")
    for header in (None, "", TOKEN, f"Basic {TOKEN}", f"Bearer {TOKEN}x", "Bearer "):
        assert not access.allows(header), header
    session = access.session()
    assert TOKEN not in session
    assert access.allows_session(session)
    assert not access.allows_session(None)
    assert not access.allows_session(TOKEN)
    assert not access.allows(f"Bearer {session}")  # the cookie is no token
    other = OpsAccess(TOKEN + "2", host="127.0.0.1", variable="SLUICE_X_HOST", service="x")
    assert not other.allows_session(session)  # a new token ends old sessions
