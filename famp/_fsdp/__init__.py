"""FSDP optimizer state: layouts, shard/unshard/reshard, loading, rekeying, DCP and `famp-reshard`.

Modules: `layout` (FSDP1/FSDP2 layout classes and the per-rank chunk arithmetic), `build`
(layouts from `{fqn: shape}`), `live` (layouts read off live wrapped models), `osd` and
`same` (optimizer state dicts checked against a layout), `shard` (full state <-> per-rank
shards), `load` (what
one rank's optimizer holds), `rekey` (parameter ids <-> names), `dcp`, `dcp_entries`,
`dcp_metadata`, `dcp_paths`, `dcp_reader` (DCP checkpoints read offline), `dcp_writer` and
`torch_save_writer` (DCP and `dcp_to_torch_save` outputs, streamed), `cli*` and `torch_save_reader`
(`famp-reshard`).
Data flows from a checkpoint or a live model, through a layout, to per-rank state. This package
imports only `famp._collectives`, `famp._compat` and `famp._typing` beyond itself.
"""
