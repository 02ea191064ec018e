"""`python -m sparkwatch.telemetry`, as the guard's supervisor starts it.

NVML's load check (a child process, telemetry.sources.nvml_preflight) starts before anything else is imported: its
child runs beside this process's imports (pydantic, prometheus_client, the sources: about 250 ms on the 2-core VM)
instead of after them, so the endpoint serves that much sooner after the guard (bench/RESULTS-telemetry-start.md).
"""

import sys

from sparkwatch.telemetry.sources.nvml_preflight import Preflight

preflight = None if "--no-nvml" in sys.argv[1:] else Preflight.start()

from sparkwatch.telemetry.telemetryprocess import main  # noqa: E402 - after the preflight's start, on purpose

raise SystemExit(main(preflight=preflight))
