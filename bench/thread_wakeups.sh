#!/bin/bash
# usage: bench/thread_wakeups.sh TREE PORT (as root): `python3 -m sparkwatch run` from TREE, idle, a scrape every 5 s;
# each thread's CPU and wake-ups (the third field of /proc/PID/task/TID/schedstat) over 30 s after 20 s to settle
TREE=$1; PORT=$2; ST=/tmp/st-$PORT; rm -rf $ST
(cd $TREE && exec python3 -m sparkwatch run --state-dir $ST --listen 127.0.0.1:$PORT --floor 1GiB > /tmp/out-$PORT.log 2>&1) &
G=$!
sleep 20
G=$(pgrep -P $G -x sparkwatch || echo $G)
T=$(cat /proc/$G/task/*/children | tr " " "\n" | grep . | head -1)
snap(){ for p in $G $T; do for t in /proc/$p/task/*; do echo "$p $(basename $t) $(cat $t/comm | tr ' ' _) $(cat $t/schedstat)"; done; done; }
snap > /tmp/a-$PORT
for i in $(seq 6); do curl -s -o /dev/null http://127.0.0.1:$PORT/metrics; sleep 5; done
snap > /tmp/b-$PORT
grep VmRSS /proc/$G/status /proc/$T/status
kill -TERM $G
python3 - $PORT <<'PY'
import sys
port=sys.argv[1]
a={ (l.split()[0],l.split()[1]):l.split() for l in open(f'/tmp/a-{port}')}
tot=0
for l in open(f'/tmp/b-{port}'):
    f=l.split(); k=(f[0],f[1])
    if k in a:
        o=a[k]; c=(int(f[3])-int(o[3]))/1e6; tot+=c
        w=(int(f[5])-int(o[5]))/30
        if c>0 or w>0: print(f"{f[2]:24s} cpu {c:7.2f} ms  wakeups/s {w:5.2f}")
print(f"total {tot:.1f} ms in 30 s = {tot/300:.3f} % of a core")
PY
