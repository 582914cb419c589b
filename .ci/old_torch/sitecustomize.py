"""Shims for running the CUDA checks on a GPU image whose torch is older than famp's floor (2.13).

Not part of famp, and not a claim of support: the lent GPU machines of 2026-11 have only
torch 2.11.0+cu130, and no newer CUDA build can be brought to them. With this folder first on
`PYTHONPATH` (`PYTHONPATH=.ci/old_torch:. bash .ci/cuda`), Python imports it at startup; on
torch 2.13 or later it does nothing. docs/torch-versions.md, "What ran on a GPU", lists what
ran with it. On torch 2.11 it:

1. adds `torch._foreach_clone` (missing) as torch 2.13's CUDA kernel of it works
   (pytorch/pytorch#177421): an empty tensor like each, then one multi-tensor `_foreach_copy_`,
   as an operator (compiled: one opaque node, where torch 2.13's inductor writes its own kernel);
2. leaves the named-tensor (`Dimname`) overloads that torch 2.11's autocast registers out of the
   ops famp reads off the dispatcher: fake tensors cannot run them, so no rule can be derived;
3. installs torch 2.13's `init_gpu_context`: torch 2.11's initialises an XPU context for a fake
   XPU tensor when a CUDA GPU is present, which fails on a CUDA build.
"""

import sys

import torch

if tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13):
    import torch._subclasses.fake_tensor as fake_tensor

    import famp._autocast.tables as tables

    if not hasattr(torch, "_foreach_clone"):

        @torch.library.custom_op("famp_shim::foreach_clone", mutates_args=())
        def foreach_clone(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
            copies = [torch.empty_like(t) for t in tensors]
            torch._foreach_copy_(copies, tensors)
            return copies

        @foreach_clone.register_fake
        def _(tensors):  # compiled: one opaque node; its copies keep the tensors' strides
            return [torch.empty_like(t) for t in tensors]

        torch._foreach_clone = foreach_clone

    _registered_ops = tables.registered_ops

    def registered_ops(*args, **kwargs):
        ops = _registered_ops(*args, **kwargs)
        return type(ops)(op for op in ops if "name" not in op[1].lower())

    def init_gpu_context(device):  # torch 2.13's: only the current accelerator's context
        if torch.accelerator.current_accelerator(True) == device.type:
            torch.empty(1, device=device)

    tables.registered_ops = registered_ops
    fake_tensor.init_gpu_context = init_gpu_context
    # stderr: pytest-xdist starts its workers through their stdout, which must carry nothing else
    v = torch.__version__
    print(f"famp: shims for torch {v} (.ci/old_torch), not a supported torch", file=sys.stderr)
