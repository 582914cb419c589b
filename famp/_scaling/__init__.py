"""Loss scaling: `GradScaler`'s dynamics as pure functions over an immutable state.

`state.py` defines `ScalerState`; `checks.py` validates Python values (the one path of every state's
statics); `build.py` builds states (`init_scaler`), `state_dict.py` converts them to and from
`GradScaler`'s dict; `update.py` advances the scale. `trees.py` and `unscale.py` apply the scale to
trees (`kernels.py`: the kernel's exact results out of place, with `eager_cpu.py`, `program.py` and
`fused.py`; `differentiable.py` for grads that carry a graph); `choice.py` chooses between trees
(`select_tree`; compiled on the CPU, one `famp::select_` operator); `step.py` and
`optimizer_step.py` (with `undo.py`, a skipped non-fused step undone) compose them into training
steps; `report.py` says where an overflow came from.
Data flows one way: state -> scale -> unscale_and_check -> update_scale. This room never imports
autocast or FSDP; collectives go through `famp/_collectives.py`.
"""
