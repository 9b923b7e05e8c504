"""Kernel sequences of CUDA graph replays from a chrome trace: per graph launch, kernels in order."""
import json, sys, collections
tr = json.load(open(sys.argv[1]))
X = [e for e in tr["traceEvents"] if e.get("ph") == "X"]
launch = {e["args"].get("correlation"): e for e in X if e.get("cat") == "cuda_runtime" and e["name"] == "cudaGraphLaunch"}
gpu = [e for e in X if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
by = collections.defaultdict(list)
other = []
for e in gpu:
    c = e["args"].get("correlation")
    (by[c] if c in launch else other).append(e)
order = sorted(by, key=lambda c: launch[c]["ts"])
print(f"{len(order)} graph launches; {sum(len(by[c]) for c in order)} graph kernels; {len(other)} other device events")
for i, c in enumerate(order):
    ks = by[c]
    print(f"launch {i}: {len(ks)} kernels, {sum(k['dur'] for k in ks):.0f} us")
want = [int(a) for a in sys.argv[2].split(",")] if len(sys.argv) > 2 else []
for i in want:
    ks = sorted(by[order[i]], key=lambda k: k["ts"])
    print(f"\n=== launch {i}: {len(ks)} kernels, busy {sum(k['dur'] for k in ks):.0f} us, span {ks[-1]['ts'] + ks[-1]['dur'] - ks[0]['ts']:.0f} us")
    prev = None
    for k in ks:
        gap = k["ts"] - (prev["ts"] + prev["dur"]) if prev else 0
        print(f"  {k['dur']:8.1f} gap {gap:5.1f}  {k['name'][:100]}")
        prev = k
# non-graph device events in one step, in order (step = second half)
print("\n=== non-graph device events (all), by name")
agg = collections.defaultdict(lambda: [0, 0.0])
for e in other:
    agg[e["name"][:90]][0] += 1; agg[e["name"][:90]][1] += e["dur"]
for n, (c, d) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:40]:
    print(f"  {d:9.1f} us {c:5d}x {n}")
print("\n=== all device events by name")
agg = collections.defaultdict(lambda: [0, 0.0])
for e in gpu:
    agg[e["name"][:90]][0] += 1; agg[e["name"][:90]][1] += e["dur"]
for n, (c, d) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:70]:
    print(f"  {d:9.1f} us {c:5d}x {n}")
