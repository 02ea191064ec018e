"""The Prometheus exporter: renders the latest Snapshot and the guard's counters; does no I/O at scrape time."""
