"""The one settings schema (pydantic), read by the CLI and the telemetry process; the guard gets the validated values
as plain JSON (`sparkwatch.common.guardconfig`) and never imports this package."""
