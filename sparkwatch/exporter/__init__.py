"""The Prometheus exporter: renders the latest Snapshot and the guard's counters; no I/O at scrape time."""
