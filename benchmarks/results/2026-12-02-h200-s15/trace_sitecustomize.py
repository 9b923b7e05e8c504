import os
import torch.profiler
_orig_exit = torch.profiler.profile.__exit__
def _exit(self, *args):
    result = _orig_exit(self, *args)
    if os.environ.get("S15_TRACE"):
        self.export_chrome_trace(os.environ["S15_TRACE"])
    return result
torch.profiler.profile.__exit__ = _exit
