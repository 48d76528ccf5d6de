"""API keys -> tenants.

Keys are never stored, only their sha256 hex digests, in a tenants file named by ``SLUICE_EDGE_TENANTS_FILE``
(``.json`` or ``.toml``)::

    [tenants.acme]
    key_sha256 = ["<sha256 hex of the key>"]     # printf %s "$KEY" | sha256sum
    models = ["demo-gpt"]                         # optional: the models it may use (default: all)
    requests_per_min = 600                        # optional limits, over all its models and shared by
    tokens_per_min = 200000                       # every edge (see ingest/quota.py): tokens are reserved
    max_concurrency = 16                          # as prompt + max_tokens, then what was really used
    allow_ignore_eos = false                      # optional: may ask for ignore_eos (load tests)
    [tenants.acme.model_limits.demo-gpt]          # optional: tighter limits on one model
    tokens_per_min = 50000

Without a file the edge knows one tenant, ``demo``, with key ``sk-sluice-demo`` and no limits: fine on
loopback, never on a shared host, so an edge without a file refuses to bind any other address
(:func:`require_tenants_file`).
"""

from __future__ import annotations

import hashlib
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated

import msgspec

from ingest.errors import AuthenticationFailed, CatalogueError
from ingest.quota import ALL_MODELS, Key, Limits
from ingest.settings import EdgeSettings
from schemas.settings import SettingsError, is_loopback

DEMO_TENANT = "demo"
DEMO_KEY = "sk-sluice-demo"

Sha256Hex = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")]


class Tenant(Limits, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A tenant and its limits (``Limits``: over all its models), plus tighter ones per model."""

    name: str = ""
    key_sha256: list[Sha256Hex] = []
    models: frozenset[str] | None = None
    model_limits: dict[str, Limits] = {}
    allow_ignore_eos: bool = False
    """May ask for ``ignore_eos`` (generate to ``max_tokens`` whatever the model says): a load-test switch
    that makes every request as long as it may be, off unless granted."""

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models

    @property
    def total(self) -> Limits:
        """The limits over all its models."""
        return Limits(
            requests_per_min=self.requests_per_min,
            tokens_per_min=self.tokens_per_min,
            max_concurrency=self.max_concurrency,
        )

    def limits(self, model: str) -> Limits | None:
        return self.total if model == ALL_MODELS else self.model_limits.get(model)

    def checks(self, model: str) -> list[tuple[Key, Limits]]:
        """The limits a request for ``model`` must fit: the tenant's total, then the model's own."""
        out = [((self.name, ALL_MODELS), self.total)]
        per_model = self.model_limits.get(model)
        if per_model is not None:
            out.append(((self.name, model), per_model))
        return out


class _TenantsFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    tenants: dict[Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}$")], Tenant]


def _no_edge_local_limits(loaded: object) -> None:
    """``requests_per_s``/``burst`` were limits of one edge (N edges let a tenant through N times): say
    what replaced them instead of a bare unknown-field error."""
    tenants = loaded.get("tenants") if isinstance(loaded, dict) else None
    for name, tenant in (tenants or {}).items() if isinstance(tenants, dict) else ():
        if isinstance(tenant, dict) and {"requests_per_s", "burst"} & tenant.keys():
            raise msgspec.ValidationError(
                f"tenant {name!r}: requests_per_s and burst were per-edge limits and are gone; use "
                "requests_per_min (and tokens_per_min), which every edge shares"
            )


def require_tenants_file(settings: EdgeSettings) -> None:
    """The demo key is public: refuse (:class:`SettingsError`) an edge on a non-loopback address without
    a tenants file."""
    if settings.edge_tenants_file is None and not is_loopback(settings.edge_host):
        raise SettingsError(
            f"SLUICE_EDGE_HOST={settings.edge_host!r} is not a loopback address and SLUICE_EDGE_TENANTS_FILE "
            f"is unset: anyone could use the demo key {DEMO_KEY}; set SLUICE_EDGE_TENANTS_FILE (see "
            "ingest/auth.py) or bind 127.0.0.1"
        )


def hash_key(key: str) -> str:
    # surrogateescape: a header byte that is not UTF-8 arrives as a lone surrogate; it hashes to no key
    # (a 401) instead of raising (a 500 anyone could cause without a key)
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


class TenantDirectory:
    """Looks tenants up by the hash of their API key."""

    def __init__(self, tenants: Mapping[str, Tenant]) -> None:
        self._by_hash: dict[str, Tenant] = {}
        self._by_name: dict[str, Tenant] = {}
        for name, tenant in tenants.items():
            named = msgspec.structs.replace(tenant, name=name)
            self._by_name[name] = named
            for digest in tenant.key_sha256:
                if digest in self._by_hash:
                    raise CatalogueError(
                        f"tenants {self._by_hash[digest].name!r} and {name!r} share an API key"
                    )
                self._by_hash[digest] = named

    @classmethod
    def demo(cls) -> TenantDirectory:
        return cls({DEMO_TENANT: Tenant(key_sha256=[hash_key(DEMO_KEY)], allow_ignore_eos=True)})

    @classmethod
    def from_file(cls, path: str | Path) -> TenantDirectory:
        path = Path(path)
        try:
            raw = path.read_bytes()
            loaded = tomllib.loads(raw.decode()) if path.suffix == ".toml" else msgspec.json.decode(raw)
            _no_edge_local_limits(loaded)
            parsed = msgspec.convert(loaded, _TenantsFile)
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, msgspec.DecodeError) as exc:
            raise CatalogueError(f"tenants file {path}: {exc}") from exc
        return cls(parsed.tenants)

    @classmethod
    def load(cls, path: str | None) -> TenantDirectory:
        return cls.demo() if path is None else cls.from_file(path)

    def named(self, name: str) -> Tenant | None:
        """The tenant called ``name`` (work it started, e.g. a batch, goes on under its current limits)."""
        return self._by_name.get(name)

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
