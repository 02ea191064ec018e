#!/bin/bash
# The GPU host's idle figures in one device call (bench/RESULTS-idle.md): NVML's calls and memory, the idle agent
# A/B against a baseline tree, and each thread's wake-ups. From the repository root, with the project's wheels carried
# in .whl/ and the baseline tree (`git archive COMMIT`) in .gpu/base/:
#   bash bench/gpu_host.sh            (OUT names the folder for the A/B table; the device tool sets it)
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site LANG=C.UTF-8
OUT=${OUT:-/tmp}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "== NVML calls: CPU per call"; timeout 60 python3 bench/nvml_call_cost.py
echo "== NVML memory, stage by stage"; timeout 30 python3 bench/nvml_rss.py
echo "== idle A/B"
timeout 330 python3 bench/idle_bench.py --rounds 2 --seconds 30 --no-earlyoom --baseline .gpu/base \
    --out "$OUT/RESULTS-idle-gpu.md" 2>&1 | grep -v "last cycle"
cat "$OUT/RESULTS-idle-gpu.md"
echo "== wake-ups per thread"; timeout 80 bash bench/thread_wakeups.sh . 19501 2>&1 | tail -25
