"""Tables of the control plane. Importing this module registers them all on Base.metadata."""

from loraplex.platform.models._common import MAX_ROW_ID, utcnow
from loraplex.platform.models.adapter import Adapter, AdapterVersion, VersionStatus
from loraplex.platform.models.keys import ALL_SCOPES, AdminKey, ApiKey, KeySecret, Scope
from loraplex.platform.models.tenant import Plan, Tenant, TenantStatus
from loraplex.platform.models.usage import UsageRecord

__all__ = [
    "ALL_SCOPES", "MAX_ROW_ID", "Adapter", "AdapterVersion", "AdminKey", "ApiKey", "KeySecret", "Plan", "Scope", "Tenant", "TenantStatus",
    "UsageRecord", "VersionStatus", "utcnow",
]
