"""The metrics endpoint: prometheus_client collectors that only render what the telemetry loop and the channel
already hold, and `contract`, the one list of every metric (names, types, labels, help texts)."""
