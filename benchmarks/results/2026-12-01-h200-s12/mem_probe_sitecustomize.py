"""Bench worker probe: per-step/phase memory peaks and, at exit, what was live at the run's allocated peak."""
import atexit, os, collections
import torch
OUT = os.environ.get("MEM_OUT")
if OUT and torch.cuda.is_available():
    from lightning_ft.bench import systems
    orig = systems.StepTimer._memory_phase
    def phase(self, name):
        if self.device.startswith("cuda"):
            print(f"memphase step={len(self.times)} {name} alloc_peak={torch.cuda.max_memory_allocated()/2**30:.3f} "
                  f"reserved_peak={torch.cuda.max_memory_reserved()/2**30:.3f}", flush=True)
        return orig(self, name)
    systems.StepTimer._memory_phase = phase
    torch.cuda.memory._record_memory_history(max_entries=400000, stacks="python")
    def dump():
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        traces = snap["device_traces"][0]
        live, cur, best, best_live, best_i = {}, 0, -1, None, -1
        for i, ev in enumerate(traces):
            a = ev["action"]
            if a == "alloc":
                live[ev["addr"]] = ev; cur += ev["size"]
                if cur > best:
                    best, best_i = cur, i
                    best_live = dict(live)
            elif a == "free_completed" or a == "free_requested":
                if a == "free_requested" and ev["addr"] in live:
                    cur -= live.pop(ev["addr"])["size"]
        groups = collections.Counter(); counts = collections.Counter()
        for ev in (best_live or {}).values():
            frames = [f for f in ev.get("frames", []) if "lightning_ft" in f["filename"] or "transformers" in f["filename"] or "peft" in f["filename"]]
            key = " <- ".join(f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}" for f in frames[:4]) or "?"
            groups[key] += ev["size"]; counts[key] += 1
        with open(os.path.join(OUT, f"mem_peak_{os.getpid()}.txt"), "w") as fh:
            fh.write(f"trace events {len(traces)}; peak (traced allocs, since recording began) {best/2**30:.3f} GiB at event {best_i}\n")
            for key, size in groups.most_common(40):
                fh.write(f"{size/2**20:10.1f} MiB {counts[key]:5d}x  {key}\n")
    atexit.register(dump)
