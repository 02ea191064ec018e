"""sparkwatch: a node agent for NVIDIA DGX Spark.

The guard keeps the box alive by SIGKILLing LLM-engine process trees before the unified memory pool runs dry; the
telemetry shows what the node does during long engine boots. See README.md and docs/contract.md.
"""

__version__ = "0.1.0"
