"""Host work between the step timer's sync and the first graph launch, from a chrome trace with stacks."""
import json, sys
tr = json.load(open(sys.argv[1]))
X = [e for e in tr["traceEvents"] if e.get("ph") == "X"]
t0 = min(e["ts"] for e in X)
syncs = sorted((e for e in X if e.get("cat") == "cuda_runtime" and e["name"] in ("cudaDeviceSynchronize", "cudaStreamSynchronize")), key=lambda e: e["ts"])
launches = sorted(e["ts"] for e in X if e.get("cat") == "cuda_runtime" and e["name"] == "cudaGraphLaunch")
gpu = sorted((e for e in X if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
py = sorted((e for e in X if e.get("cat") in ("python_function", "cpu_op", "user_annotation", "cuda_runtime")), key=lambda e: e["ts"])
for s in syncs:
    a = s["ts"] + s["dur"]
    nxt = [t for t in launches if t > a] + [x["ts"] for x in syncs if x["ts"] > a]
    if not nxt:
        continue
    b = min(nxt)
    if b - a > 30000 or b - a < 300:
        continue
    busy = sum(max(0, min(e["ts"] + e["dur"], b) - max(e["ts"], a)) for e in gpu if e["ts"] < b and e["ts"] + e["dur"] > a)
    print(f"=== window +{(a - t0) / 1e3:.2f} ms .. +{(b - t0) / 1e3:.2f} ms: {(b - a) / 1e3:.2f} ms, GPU busy {busy / 1e3:.2f} ms (after {s['name']} {s['dur'] / 1e3:.2f} ms)")
    inside = [e for e in py if e["ts"] >= a - 1 and e["ts"] < b and e["dur"] >= float(sys.argv[2] if len(sys.argv) > 2 else 40)]
    stack = []
    for e in inside:
        while stack and e["ts"] >= stack[-1]["ts"] + stack[-1]["dur"]:
            stack.pop()
        if len(stack) < int(sys.argv[3] if len(sys.argv) > 3 else 14):
            print(f"  {'  ' * len(stack)}{e['dur']:7.0f} us +{(e['ts'] - a) / 1e3:6.2f} {e.get('cat', '')[:6]} {e['name'][:110]}")
        stack.append(e)
