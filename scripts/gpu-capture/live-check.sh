#!/usr/bin/env bash
# On a machine with a live NVIDIA driver (the device tool's H200, or a Spark): the whole daemon and doctor for real.
# Starts `sparkwatch run` while a CUDA load runs, scrapes /metrics idle and under load, runs `sparkwatch doctor
# --json` and the live-driver tests, and leaves everything under $OUT (default ./gpu-live-out).
#   bash scripts/gpu-capture/live-check.sh
# Wheels for packages the machine lacks may sit in .whl/ (installed into /tmp/site first).
set -u
OUT=${OUT:-./gpu-live-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 SPARKWATCH_STATE_DIR=/tmp/sw-state SPARKWATCH_LISTEN=127.0.0.1:9847 SPARKWATCH_FLOOR=1GiB
{
  echo "## uname -r"; uname -r
  echo "## /proc/driver/nvidia/version"; cat /proc/driver/nvidia/version
  echo "## /dev/nvidia*"; ls /dev/nvidia*
  echo "## /lib/modules"; ls /lib/modules 2>&1 | head
} >"$OUT/context.txt" 2>&1
python3 -m sparkwatch doctor --json >"$OUT/doctor.json" 2>"$OUT/doctor.stderr"; echo "doctor exit $?" >>"$OUT/context.txt"
python3 -m sparkwatch doctor >"$OUT/doctor.txt" 2>&1
python3 -m sparkwatch run --dry-run 2>"$OUT/daemon.log" &
DAEMON=$!
sleep 6
python3 -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:9847/metrics').read().decode(), end='')" >"$OUT/metrics-idle.prom"
nvcc -O2 -arch=sm_90 -o /tmp/burn scripts/gpu-capture/burn.cu >>"$OUT/context.txt" 2>&1
/tmp/burn 15 4 >>"$OUT/context.txt" 2>&1 &
BURN=$!
sleep 8
python3 -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:9847/metrics').read().decode(), end='')" >"$OUT/metrics-load.prom"
wait $BURN
kill -TERM $DAEMON; wait $DAEMON; echo "daemon exit $?" >>"$OUT/context.txt"
python3 -m pytest -q -p no:cacheprovider tests/test_nvml_probe.py tests/test_gpu_exporter.py >"$OUT/pytest.txt" 2>&1
echo "pytest exit $?" >>"$OUT/context.txt"
