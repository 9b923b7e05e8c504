"""Per-stream idle gaps of a chrome trace; the compute stream's gaps with the kernels around them."""
import collections, json, sys
tr = json.load(open(sys.argv[1]))
ev = [e for e in tr["traceEvents"] if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
ev.sort(key=lambda e: e["ts"])
t0, t1 = ev[0]["ts"], max(e["ts"] + e["dur"] for e in ev)
streams = collections.defaultdict(list)
for e in ev:
    streams[e["args"].get("stream", e.get("tid"))].append(e)
print(f"span {(t1 - t0) / 1e3:.2f} ms, device events {len(ev)}")
for sid, es in sorted(streams.items(), key=lambda kv: -sum(e["dur"] for e in kv[1])):
    print(f"stream {sid}: {len(es)} events, busy {sum(e['dur'] for e in es) / 1e3:.2f} ms")
# union busy
busy, end, gaps = 0.0, t0, []
for e in ev:
    s, f = e["ts"], e["ts"] + e["dur"]
    if s > end:
        gaps.append((s - end, end, prev["name"][:70], e["name"][:70]))
    busy += max(0, f - max(s, end)); end = max(end, f); prev = e
print(f"union busy {busy / 1e3:.2f} ms idle {(t1 - t0 - busy) / 1e3:.2f} ms; gaps > 10us: {len([g for g in gaps if g[0] > 10])} sum {sum(g[0] for g in gaps if g[0] > 10) / 1e3:.2f} ms; all {sum(g[0] for g in gaps) / 1e3:.2f} ms")
gaps.sort(reverse=True)
for g in gaps[:40]:
    print(f"  {g[0]:8.1f} us at +{(g[1] - t0) / 1e3:8.2f} ms after {g[2]!r} before {g[3]!r}")
cpu = [e for e in tr["traceEvents"] if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver") and e["dur"] > 300]
cpu.sort(key=lambda e: -e["dur"])
print("long runtime calls:")
for e in cpu[:20]:
    print(f"  {e['dur'] / 1e3:8.2f} ms {e['name']} at +{(e['ts'] - t0) / 1e3:.2f}")
ops = [e for e in tr["traceEvents"] if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation", "python_function") and e["dur"] > 1000]
ops.sort(key=lambda e: e["ts"])
print("host ops > 1 ms (in time order):")
for e in ops[:80]:
    print(f"  +{(e['ts'] - t0) / 1e3:8.2f} ms {e['dur'] / 1e3:8.2f} ms {e['name'][:90]}")
