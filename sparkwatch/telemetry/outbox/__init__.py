"""The alert outbox: events spooled durably under <state_dir>/outbox/, delivered to the webhook at least once.

Why a spool of files: the receiver may be down for hours and sparkwatch may restart meanwhile (an update, a reboot
after a stranded driver). Each alert is a file until the receiver answered 2xx; on start every file left is sent
again. The event id travels as `X-Sparkwatch-Event-Id`, so a receiver can drop a duplicate: at least once, never at
most once. One concern a file, in the style of node_exporter's collectors:

- spooldir.py: the directory and its files: load what is left from before (reconciling a `.pending-` file with
  events.jsonl after a crash), quarantine what is not ours to `outbox/bad/`, remove a file once delivered or dropped.
  The file names and the prepare-then-commit protocol are common/spool.py's, shared with the guard process.
- queue.py: the retry queue, pure over a clock passed in: which item next, per-item backoff with jitter, a transport
  failure pausing the whole queue, an item the receiver rejects pushed back alone, the cap on kept alerts.
- transport.py: one POST: sign (HMAC-SHA256), send within one deadline, never follow a redirect, classify the answer
  (delivered, item rejected, transport failure); the URL and secret scrubbed from every error.
- outbox.py: `Outbox`, the component that wires them: the lock, the supervised worker thread, the counters the
  exporter reads, rate-limited log lines, and its own `outbox_dropped` / `outbox_quarantined` events.
"""

from sparkwatch.telemetry.outbox.outbox import Outbox
from sparkwatch.telemetry.outbox.transport import DeliveryError, sign

__all__ = ["DeliveryError", "Outbox", "sign"]
