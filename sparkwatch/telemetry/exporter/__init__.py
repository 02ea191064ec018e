"""The metrics endpoint: prometheus_client collectors that only render what the telemetry loop and the channel
already hold, and `contract`, the one list of every metric (names, types, labels, help texts).

prometheus_client's package `__init__` is deferred here, before any of the exporter's modules imports one of its
submodules: it imports `prometheus_client.exposition`, and with it ssl and urllib.request, which the endpoint does not
use (`exposition`, this package's encoders, says why and what it saves).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Any


def defer_package_init(name: str = "prometheus_client") -> None:
    """Register package `name` with its `__init__` not yet run: it runs at the first attribute asked of the package
    (a submodule's import asks none). No-op when the package is imported already or not installed."""
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None or spec.submodule_search_locations is None:
        return
    package = importlib.util.module_from_spec(spec)
    loader = spec.loader

    def run_init(attr: str) -> Any:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)  # probes (__wrapped__, __file__ lookups, ...) do not load the package
        if importlib.util.find_spec(f"{name}.{attr}") is not None:  # `from . import values` in a submodule
            return importlib.import_module(f"{name}.{attr}")
        del package.__dict__["__getattr__"]
        loader.exec_module(package)
        return getattr(package, attr)

    package.__dict__["__getattr__"] = run_init
    sys.modules[name] = package


defer_package_init()
