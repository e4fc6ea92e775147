import os

import torch

# Without CUDA the kernels run under Triton's interpreter, which must be chosen before any
# kernel is decorated (tokenspeed_kernels does the same on import; this covers direct imports).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
