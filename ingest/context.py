"""What the HTTP routes and WebSocket sessions of one edge share."""

from __future__ import annotations

from dataclasses import dataclass, field

from aiohttp import web

from ingest.admission import Admission
from ingest.auth import TenantDirectory
from ingest.dispatch import Dispatcher
from ingest.gateway import Gateway
from ingest.models import ModelCatalogue
from ingest.prepare import Preparer
from ingest.settings import EdgeSettings


@dataclass
class EdgeContext:
    settings: EdgeSettings
    gateway: Gateway
    catalogue: ModelCatalogue
    tenants: TenantDirectory
    admission: Admission
    dispatcher: Dispatcher
    preparer: Preparer
    sockets: set[web.WebSocketResponse] = field(default_factory=set)
    sockets_of: dict[str, int] = field(default_factory=dict)
    """Open WebSockets per tenant (``edge_ws_max_per_tenant``)."""
