#!/usr/bin/env python3
"""Per-thread voluntary context switches and CPU ticks of every running
`kvrelay serve` process, sampled every 0.5 s for SECONDS, printed per process
at the end (first sample to last). Run it beside `kvrelay bench --only pacing`
to see which thread wakes: the first thread after the main one is the Go
runtime's sysmon (docs/bench/log/2026-12-05-relay-quiet-syscalls.md).

    python3 bench/serve-threads.py SECONDS
"""
import os, time, sys, json
# Samples every kvrelay serve process's threads: voluntary switches and CPU ticks; keeps the last sample per pid.
last = {}
start = {}
end = time.time() + float(sys.argv[1])
while time.time() < end:
    for pid in os.listdir('/proc'):
        if not pid.isdigit(): continue
        try:
            cmd = open(f'/proc/{pid}/cmdline','rb').read().split(b'\0')
        except Exception: continue
        if len(cmd) < 2 or b'kvrelay' not in os.path.basename(cmd[0]): continue
        if cmd[1] != b'serve': continue
        snap = {}
        try:
            for tid in sorted(os.listdir(f'/proc/{pid}/task'), key=int):
                st = open(f'/proc/{pid}/task/{tid}/status').read()
                v = int([l for l in st.splitlines() if l.startswith('voluntary_ctxt_switches')][0].split()[1])
                stat = open(f'/proc/{pid}/task/{tid}/stat').read().rsplit(')',1)[1].split()
                ticks = int(stat[11]) + int(stat[12])
                snap[tid] = (v, ticks)
        except Exception: continue
        key = (pid, cmd[0].decode() + (' ' + b' '.join(cmd[2:4]).decode() if b'--gomaxprocs' in cmd else ''))
        if key not in start: start[key] = (time.time(), snap)
        last[key] = (time.time(), snap)
    time.sleep(0.5)
for key, (t1, s1) in last.items():
    t0, s0 = start[key]
    tids = sorted(s1, key=int)
    rows = []
    for tid in tids:
        v0, k0 = s0.get(tid, (0, 0))
        v1, k1 = s1[tid]
        rows.append((tid, v1 - v0, k1 - k0))
    print(key[1], key[0], f'{t1-t0:.1f}s', 'per-thread (tid, vol switches, ticks):', rows)
