import os
import torch.profiler
_orig_init = torch.profiler.profile.__init__
def _init(self, *args, **kwargs):
    if os.environ.get("S18_STACK"):
        kwargs["with_stack"] = True
    _orig_init(self, *args, **kwargs)
torch.profiler.profile.__init__ = _init
_orig_exit = torch.profiler.profile.__exit__
def _exit(self, *args):
    result = _orig_exit(self, *args)
    if os.environ.get("S18_TRACE"):
        self.export_chrome_trace(os.environ["S18_TRACE"])
    return result
torch.profiler.profile.__exit__ = _exit
