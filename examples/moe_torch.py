"""Run the toy MoE layer in PyTorch on 4 local gloo ranks. Backend: $OMNIEP_BACKEND.

The layer itself is omniep/examples/moe_torch.py; it names no backend.
"""
from omniep.examples.moe_torch import rank_main
from omniep.testing.procs import run_ranks

if __name__ == "__main__":
    for layout in ("rank_major", "expert_major"):
        print(run_ranks(rank_main, 4, args=(layout,), timeout=300)[0])
