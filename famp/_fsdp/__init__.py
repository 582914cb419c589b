"""FSDP optimizer state: layouts, shard/unshard/reshard, loading, rekeying, DCP and `famp-reshard`.

`layout` describes which piece of every parameter each rank holds (built from names and shapes,
or read off a live model by `live`); `osd` checks optimizer state dicts against a layout;
`shard` cuts and joins the full FQN-keyed state; `load` builds what one rank's optimizer holds;
`rekey` maps parameter ids to names; `dcp*` read and write DCP checkpoints offline; `cli*` is
the `famp-reshard` command. Data flows from a checkpoint or a live model, through a layout, to
per-rank state; this package imports only `famp._collectives`, `famp._compat` and `famp._typing`.
"""
