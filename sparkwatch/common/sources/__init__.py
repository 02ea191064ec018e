"""Read-only /proc and /sys adapters both processes use (meminfo, the process table, the kernel log, buddyinfo,
PSI, engine trees). Each takes its root as an argument; a read error is a typed error, never a reason to kill."""
