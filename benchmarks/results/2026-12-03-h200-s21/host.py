"""Host timeline of one profiled step: the Python call tree from the step's start to its first graph launch,
and the device idle in that window. Usage: host.py TRACE [step_index]"""
import json, sys
tr = json.load(open(sys.argv[1]))
step = int(sys.argv[2]) if len(sys.argv) > 2 else 1
ev = [e for e in tr["traceEvents"] if e.get("ph") == "X"]
py = [e for e in ev if e.get("cat") == "python_function"]
starts = sorted(e["ts"] for e in py if e["name"].endswith("on_train_batch_start"))
ends = sorted(e["ts"] + e["dur"] for e in py if e["name"].endswith("on_train_batch_end") and "systems.py" in e["name"])
print(f"{len(starts)} batch starts; {len(py)} python events")
t0 = starts[min(step, len(starts) - 1)]
launches = sorted(e["ts"] for e in ev if e.get("cat") == "cuda_runtime" and e["name"] in ("cudaGraphLaunch",) and e["ts"] > t0)
t1 = launches[0] if launches else t0 + 5000
print(f"window: batch start -> first graph launch: {(t1 - t0) / 1e3:.3f} ms")
dev = sorted([e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")], key=lambda e: e["ts"])
first = [e for e in dev if e["ts"] >= t0][:1]
if first:
    print(f"first device event after batch start at +{(first[0]['ts'] - t0) / 1e3:.3f} ms: {first[0]['name'][:60]}")
win = sorted([e for e in py + [e for e in ev if e.get("cat") in ("cpu_op", "cuda_runtime")] if t0 <= e["ts"] < t1], key=lambda e: (e["ts"], -e["dur"]))
stack = []
MIN = float(sys.argv[3]) if len(sys.argv) > 3 else 40.0
for e in win:
    while stack and e["ts"] >= stack[-1]["ts"] + stack[-1]["dur"]:
        stack.pop()
    depth = len(stack)
    stack.append(e)
    if e["dur"] >= MIN and depth <= 40:
        print(f"{'  ' * min(depth, 30)}{e['dur']:9.1f} +{(e['ts'] - t0) / 1e3:7.3f} [{e.get('cat')[:3]}] {e['name'][:110]}")
# device idle per step between consecutive step starts
