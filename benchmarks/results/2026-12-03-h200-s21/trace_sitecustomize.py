# Session 21: the bench's profiler with Python stacks (python_function events) and a chrome trace at exit.
import os
import torch.profiler
_orig_init = torch.profiler.profile.__init__
_orig_exit = torch.profiler.profile.__exit__
def _init(self, *args, **kwargs):
    kwargs["with_stack"] = True
    _orig_init(self, *args, **kwargs)
def _exit(self, *args):
    result = _orig_exit(self, *args)
    if os.environ.get("S21_TRACE"):
        self.export_chrome_trace(os.environ["S21_TRACE"])
    return result
torch.profiler.profile.__init__ = _init
torch.profiler.profile.__exit__ = _exit
