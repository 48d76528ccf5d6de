"""What the HTTP routes and WebSocket sessions of one edge share."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ingest.admission import Admission
from ingest.auth import TenantDirectory
from ingest.dispatch import Dispatcher
from ingest.gateway import Gateway
from ingest.models import ModelCatalogue
from ingest.prepare import Preparer
from ingest.settings import EdgeSettings
from monitoring.access import HostAllowList

if TYPE_CHECKING:
    from ingest.ws import WsSession


@dataclass
class EdgeContext:
    settings: EdgeSettings
    gateway: Gateway
    catalogue: ModelCatalogue
    tenants: TenantDirectory
    admission: Admission
    dispatcher: Dispatcher
    preparer: Preparer
    sockets: set[WsSession] = field(default_factory=set)
    """The open WebSockets' sessions (shutdown closes them)."""
    sockets_of: dict[str, int] = field(default_factory=dict)
    """Open WebSockets per tenant (``edge_ws_max_per_tenant``)."""

    @functools.cached_property
    def origins(self) -> HostAllowList:
        """The sites whose pages may open a WebSocket (``edge_allowed_origins``, else the allowed hosts)."""
        s = self.settings
        return HostAllowList(s.edge_allowed_origins or s.edge_allowed_hosts, s.edge_host)
