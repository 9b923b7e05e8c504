"""Gap analysis of a chrome trace: GPU busy union, idle gaps, per-kernel totals."""
import json, sys, collections
tr = json.load(open(sys.argv[1]))
ev = [e for e in tr["traceEvents"] if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
ev.sort(key=lambda e: e["ts"])
print("device events", len(ev))
t0, t1 = ev[0]["ts"], max(e["ts"] + e["dur"] for e in ev)
busy, end, gaps = 0.0, t0, []
for e in ev:
    s, f = e["ts"], e["ts"] + e["dur"]
    if s > end:
        gaps.append((s - end, end, e["name"][:80]))
    busy += max(0, f - max(s, end))
    end = max(end, f)
print(f"span {(t1-t0)/1e3:.2f} ms busy {busy/1e3:.2f} ms idle {(t1-t0-busy)/1e3:.2f} ms")
gaps.sort(reverse=True)
print("gaps > 20us:", len([g for g in gaps if g[0] > 20]), "sum", sum(g[0] for g in gaps if g[0] > 20) / 1e3, "ms; all gaps", sum(g[0] for g in gaps) / 1e3)
for g in gaps[:25]:
    print(f"  {g[0]:9.1f} us at +{(g[1]-t0)/1e3:8.2f} ms before {g[2]}")
tot = collections.Counter(); cnt = collections.Counter()
for e in ev:
    tot[e["name"][:110]] += e["dur"]; cnt[e["name"][:110]] += 1
print("per-kernel totals (ms over the trace):")
for n, d in tot.most_common(70):
    print(f"  {d/1e3:8.3f} ms {cnt[n]:6d}x  {n}")
# host-side: cpu ops with long durations (sync)
cpu = [e for e in tr["traceEvents"] if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver") and e["dur"] > 500]
cpu.sort(key=lambda e: -e["dur"])
print("long runtime calls:")
for e in cpu[:15]:
    print(f"  {e['dur']/1e3:8.2f} ms {e['name']} at +{(e['ts']-t0)/1e3:.2f}")
