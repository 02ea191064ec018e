"""Everything that changes the world: signals (killer, the only module that sends them), the event log, the alert
outbox, and systemd."""
