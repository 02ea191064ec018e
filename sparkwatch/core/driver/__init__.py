"""The NVIDIA driver: drift against the running kernel, NVML's return codes, NVRM and Xid lines."""
