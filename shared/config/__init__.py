"""Service settings per role, read from the `TSUKIMI_*` variables (`shared.env_vars` declares them): the dataclasses
are `settings`, the reading `load` and `reader`. Import from here: `from shared.config import load_settings`.
"""

from shared.config.load import (
    COLOCATED_POLICIES,
    DEPLOYMENTS,
    ENGINES,
    POLICIES,
    REJECTION_MODES,
    ROLE_SETTINGS,
    load_role_settings,
    load_settings,
)
from shared.config.reader import ConfigError, check_http_exposure, default_instance_id, is_loopback
from shared.config.settings import (
    CacheStoreSettings,
    ClusterSettings,
    EngineSettings,
    GatewaySettings,
    SchedulerSettings,
    ServiceSettings,
)

__all__ = [
    "COLOCATED_POLICIES", "DEPLOYMENTS", "ENGINES", "POLICIES", "REJECTION_MODES", "ROLE_SETTINGS",
    "CacheStoreSettings", "ClusterSettings", "ConfigError", "EngineSettings", "GatewaySettings",
    "SchedulerSettings", "ServiceSettings", "check_http_exposure", "default_instance_id", "is_loopback",
    "load_role_settings", "load_settings",
]
