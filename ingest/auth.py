"""API keys -> tenants.

Keys are never stored, only their sha256 hex digests, in a tenants file named by ``SLUICE_EDGE_TENANTS_FILE``
(``.json`` or ``.toml``)::

    [tenants.acme]
    key_sha256 = ["<sha256 hex of the key>"]     # printf %s "$KEY" | sha256sum
    models = ["demo-gpt"]                         # optional: the models it may use (default: all)
    max_concurrency = 16                          # optional: requests in flight at once
    requests_per_s = 20.0                         # optional: sustained admission rate ...
    burst = 40                                    # ... and bucket size (default: max(1, requests_per_s))

Without a file the edge knows one tenant, ``demo``, with key ``sk-sluice-demo`` and no limits: fine on
loopback, never on a shared host.
"""

from __future__ import annotations

import hashlib
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated

import msgspec

from ingest.errors import AuthenticationFailed, CatalogueError

DEMO_TENANT = "demo"
DEMO_KEY = "sk-sluice-demo"

Sha256Hex = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")]


class Tenant(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: str = ""
    key_sha256: list[Sha256Hex] = []
    models: frozenset[str] | None = None
    max_concurrency: Annotated[int, msgspec.Meta(ge=1)] | None = None
    requests_per_s: Annotated[float, msgspec.Meta(gt=0.0)] | None = None
    burst: Annotated[int, msgspec.Meta(ge=1)] | None = None

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models


class _TenantsFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    tenants: dict[Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}$")], Tenant]


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class TenantDirectory:
    """Looks tenants up by the hash of their API key."""

    def __init__(self, tenants: Mapping[str, Tenant]) -> None:
        self._by_hash: dict[str, Tenant] = {}
        for name, tenant in tenants.items():
            named = msgspec.structs.replace(tenant, name=name)
            for digest in tenant.key_sha256:
                if digest in self._by_hash:
                    raise CatalogueError(
                        f"tenants {self._by_hash[digest].name!r} and {name!r} share an API key"
                    )
                self._by_hash[digest] = named

    @classmethod
    def demo(cls) -> TenantDirectory:
        return cls({DEMO_TENANT: Tenant(key_sha256=[hash_key(DEMO_KEY)])})

    @classmethod
    def from_file(cls, path: str | Path) -> TenantDirectory:
        path = Path(path)
        try:
            raw = path.read_bytes()
            if path.suffix == ".toml":
                parsed = msgspec.convert(tomllib.loads(raw.decode()), _TenantsFile)
            else:
                parsed = msgspec.json.decode(raw, type=_TenantsFile)
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, msgspec.DecodeError) as exc:
            raise CatalogueError(f"tenants file {path}: {exc}") from exc
        return cls(parsed.tenants)

    @classmethod
    def load(cls, path: str | None) -> TenantDirectory:
        return cls.demo() if path is None else cls.from_file(path)

    def authenticate(self, authorization: str | None, api_key: str | None = None) -> Tenant:
        """The tenant of an ``Authorization: Bearer <key>`` header, else of ``api_key`` (WebSocket query)."""
        key = api_key
        if authorization is not None:
            scheme, _, token = authorization.strip().partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                raise AuthenticationFailed("Authorization header must be 'Bearer <api key>'")
            key = token.strip()
        if not key:
            raise AuthenticationFailed(
                "You didn't provide an API key. Send it as 'Authorization: Bearer <api key>'."
            )
        tenant = self._by_hash.get(hash_key(key))
        if tenant is None:
            raise AuthenticationFailed("Incorrect API key provided.")
        return tenant
