"""Prometheus exposition of the latest Snapshot. Builds metric families from records; does no I/O at scrape time."""
