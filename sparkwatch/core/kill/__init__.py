"""The guard's decisions: when to fire, which tree dies first, budgets, footprints, and what a kill leaves."""
