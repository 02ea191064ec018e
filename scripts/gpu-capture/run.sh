#!/usr/bin/env bash
# On the device machine: build the load, start it, sample the collector idle then under load, save the context.
# Expects to run from the checkout root with .gpu/ holding this folder's files and a copy of the sparkwatch package.
set -u
G=.gpu
C=$OUT/context.txt
export PYTHONPATH=$G PYTHONUNBUFFERED=1
python3 -c 'import pynvml' 2>/dev/null || export PYTHONPATH=$G:$G/alt
{
  echo "## date"; date -u
  echo "## uname -a"; uname -a
  echo "## cat /proc/driver/nvidia/version"; cat /proc/driver/nvidia/version
  echo "## ls -l /dev/nvidia*"; ls -l /dev/nvidia*
  echo "## python / packages"; python3 --version
  python3 -c 'import pynvml, prometheus_client, importlib.metadata as m; print("pynvml", pynvml.__file__, m.version("nvidia-ml-py")); print("prometheus_client", m.version("prometheus-client"))'
  echo "## MemTotal"; grep MemTotal /proc/meminfo
  echo "## nvidia-smi -q | head -60 (idle)"; nvidia-smi -q | head -60
} >"$C" 2>&1
nvcc -O2 -arch=sm_90 -o /tmp/burn $G/burn.cu >>"$C" 2>&1 || echo "nvcc failed" >>"$C"
python3 "$G/capture.py" "$OUT" --samples 12 --interval 2.5 2>&1 | tee "$OUT/capture.log" &
CAP=$!
sleep 5
/tmp/burn 22 4 >>"$OUT/capture.log" 2>&1 &
BURN=$!
sleep 10
{
  echo "## nvidia-smi under load"; nvidia-smi
  echo "## nvidia-smi --query-gpu (under load)"
  nvidia-smi --query-gpu=name,pci.bus_id,driver_version,power.draw,utilization.gpu,temperature.gpu,clocks.sm,memory.total,memory.used --format=csv
} >>"$C" 2>&1
wait $BURN; echo "burn rc=$?" >>"$C"
wait $CAP; echo "capture rc=$?" >>"$C"
