"""Print a memory trace of benchmarks/memtrace/sitecustomize.py as a table, MiB.

    python benchmarks/memtrace/show.py DIR/scheduler-PID.jsonl

Columns: RSS and its anonymous part; of that, glibc's [heap] mapping and the other anonymous
mappings; pymalloc's arenas now and at their high-water mark and the bytes its live blocks
hold; glibc's arenas (bytes taken from the system, in use, free), its mmapped large blocks
and number of arenas; threads, asyncio tasks, objects still frozen by gc.freeze().
"""

from __future__ import annotations

import json
import sys

MIB = 1024 * 1024


def main(path: str) -> None:
    with open(path) as f:
        records = [json.loads(line) for line in f]
    t0 = records[0]["t"]
    print(f"{'tag':9}{'s':>5}{'RSS':>7}{'Anon':>7}{'heap':>7}{'anon':>7}{'pyAr':>5}{'pyHW':>5}{'pyUsed':>8}"
          f"{'gArena':>8}{'gUsed':>8}{'gFree':>8}{'mmap':>7}{'nAr':>4}{'thr':>4}{'tasks':>6}{'frozen':>7}")
    for r in records:
        if "error" in r:
            print(r)
            continue
        p, m, st, objects = r["pymalloc"], r["mallinfo2"], r["status"], dict(r["objects"])
        line = (f"{r['tag']:9}{r['t'] - t0:5.0f}{st['VmRSS'] / 1024:7.1f}{st['RssAnon'] / 1024:7.1f}"
                f"{r['heap_kib'] / 1024:7.1f}{r['anon_kib'] / 1024:7.1f}{p.get('arenas_allocated_current', 0):5}"
                f"{p.get('arenas_highwater_mark', 0):5}{p.get('bytes_in_allocated_blocks', 0) / MIB:8.2f}"
                f"{m['arena'] / MIB:8.2f}{m['uordblks'] / MIB:8.2f}{m['fordblks'] / MIB:8.2f}{m['hblkhd'] / MIB:7.2f}"
                f"{m['glibc_arenas']:4}{st['Threads']:4}{r['tasks']:6}{objects.get('<frozen>', '-'):>7}")
        if "rss_before_trim_kib" in r:
            line += f"  trimmed: {r['rss_before_trim_kib'] / 1024:.1f} -> {st['VmRSS'] / 1024:.1f}"
        print(line)


if __name__ == "__main__":
    main(sys.argv[1])
