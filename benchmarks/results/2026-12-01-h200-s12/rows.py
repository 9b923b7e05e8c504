"""Print the bench rows of results.json files: system, layers, tokens, ms (min-max), peaks, loss."""
import json, sys, glob
for path in sys.argv[1:]:
    for p in sorted(glob.glob(path)):
        for r in json.load(open(p))["rows"]:
            print(f"{p.split('/')[-2]:>12} {r['system']:>13} L{r['layers']} T{r['seq_len']} {r['status']} "
                  f"ms {r.get('ms_per_step') or 0:.1f} ({r.get('ms_min') or 0:.1f}-{r.get('ms_max') or 0:.1f}) "
                  f"alloc {r.get('peak_mem_gib') or 0:.2f} res {r.get('peak_reserved_gib') or 0:.2f} "
                  f"mfu {r.get('mfu') or 0:.3f} loss {r.get('loss_last')} x_hf {r.get('x_vs_hf_peft')}", flush=True)
