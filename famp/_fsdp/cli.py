"""`famp-reshard`: reshard an FSDP checkpoint to another world size, offline.

No process group. For rank files (the default), the source is read into famp's canonical full
form (`famp.load_dcp_optim_state` for DCP, `torch.load(weights_only=True)` for files), cut
with `famp.shard_optim_state` for an FSDP2 layout of the new world size, and written one file
per rank. From a DCP checkpoint, `--format dcp` (a DCP checkpoint for W ranks) and `--full`
(`dcp_to_torch_save`'s file) stream chunk by chunk instead (`dcp_writer.py`,
`torch_save_writer.py`). Every output is written into a temporary sibling and renamed into place
at the end, so a failure leaves nothing behind.

This module holds the parser and `main`; `cli_run.py` runs a parsed command, reading its source
with `cli_sources.py`, writing with `cli_files.py` and printing with `cli_report.py`.
"""

from __future__ import annotations

import argparse
import pickle
import re
import sys
from collections.abc import Sequence

from famp._fsdp.cli_files import check_targets
from famp._fsdp.cli_run import run
from famp._fsdp.cli_sources import UsageError, is_dcp_source

PROG = "famp-reshard"

DESCRIPTION = """\
Reshard an FSDP optimizer checkpoint to another world size, offline, in one process.

SOURCE is one of:
  * a DCP checkpoint directory: what dcp.save({"model": msd, "optim": osd}) wrote at any world
    size (FSDP2, or FSDP1 sharded), msd and osd from get_state_dict;
  * a torch.save file holding a full FQN-keyed optimizer state dict ({"state": {fqn: ...},
    "param_groups": [...]}), or a dict holding one under --key (e.g. dcp_to_torch_save output);
  * several torch.save files, one FSDP2 local shard per rank in rank order (e.g. out/rank*.pt
    from an earlier run), each with a "sharding" entry {fqn: {"shape": [...], "dim": d}} (the
    global shape and shard dim of its DTensors); files without it need --assume-dim0 where a
    parameter's shards are the same shape on every rank (dim 0 and dim 1 look alike there).
Files are read with torch.load(weights_only=True) and DCP metadata with a restricted unpickler:
nothing is unpickled beyond plain data.

Each output rank file holds what get_optimizer_state_dict(model, optim) returns on that rank
under FSDP2 on the new world size, with every DTensor replaced by its local tensor: state
tensors are the rank's dim-0 torch.chunk (trailing ranks may be empty, (0, *rest)), step and
param_groups are replicated, and "sharding" records the layout. Load it with
torch.load(path, weights_only=True)."""


EPILOG = """\
examples:
  famp-reshard ckpt/step100 -n 3 -o resharded/      # DCP at any world size -> 3 rank files
  famp-reshard ckpt/step100 --full full.pt --workers 4   # DCP -> one file, as dcp_to_torch_save
  famp-reshard ckpt/step100 -n 3 -o w3/ --format dcp --workers 3   # DCP -> DCP for 3 ranks
  famp-reshard resharded/rank*.pt -n 8 -o w8/       # 3 rank files -> 8
  famp-reshard optim_full.pt -n 64 --dry-run        # summary only

exit status: 0 on success, 1 on bad input (nothing written), 2 on a usage error."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run `famp-reshard` with `argv` (`sys.argv[1:]` if None); return the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    usage = _usage_error(args)
    if usage is not None:
        parser.error(usage)  # exits 2, as argparse does for every usage error
    args.model_key_given = args.model_key is not None
    args.model_key = "model" if args.model_key is None else args.model_key
    try:
        check_targets(args)
        return run(args)
    except UsageError as err:  # found while reading SOURCE: needs an option
        parser.error(_one_line(err))
    except (ValueError, KeyError, TypeError, OSError, RuntimeError, pickle.UnpicklingError) as err:
        message = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"{PROG}: error: {_one_line(message)}", file=sys.stderr)
        return 1
    except Exception as err:  # bad input must never end in a traceback
        print(f"{PROG}: error: {type(err).__name__}: {_one_line(err)}", file=sys.stderr)
        return 1


def _one_line(message: object) -> str:
    return " ".join(str(message).split())


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("sources", nargs="+", metavar="SOURCE", help="checkpoint to read")
    parser.add_argument(
        "-n", "--world-size", type=_world_size, help="number of ranks to reshard to"
    )
    parser.add_argument(
        "-o",
        "--out",
        metavar="DIR",
        help="write rank00000.pt ... (--format dcp: a DCP checkpoint) into this new directory, "
        "never a SOURCE, a path inside one or a directory holding one",
    )
    parser.add_argument(
        "--full",
        metavar="FILE",
        help="write one torch.save file: from a DCP checkpoint, the whole checkpoint as "
        "dcp_to_torch_save writes it (streamed); from files, the full optimizer state dict",
    )
    parser.add_argument(
        "--key",
        default="optim",
        help="key of the optimizer state in a DCP checkpoint or a dict file (default: optim)",
    )
    parser.add_argument(
        "--model-key",
        help="top-level key of the model state in a DCP checkpoint or a full state-dict file, "
        "read for the parameters' shapes; given, it must be there (default: 'model' where "
        "present; without it the shapes come from the optimizer state)",
    )
    parser.add_argument(
        "--format",
        choices=("rank-files", "dcp"),
        default="rank-files",
        help="what -o DIR holds: rank*.pt files (default), or a DCP checkpoint that dcp.load "
        "reads on WORLD_SIZE ranks (every entry of a DCP SOURCE, re-chunked, streamed)",
    )
    parser.add_argument(
        "--workers",
        type=_positive_int,
        help="processes that write --format dcp output ranks, or the --full file's tensors, in "
        "parallel, from a DCP checkpoint (the same files for any N; default 1)",
    )
    parser.add_argument(
        "--max-memory",
        type=parse_size,
        metavar="SIZE",
        help="memory budget beyond one tensor, e.g. 512M or 2G, for --full and --format dcp "
        "(which stream chunk by chunk): the copy buffer, and fewer --workers if needed",
    )
    parser.add_argument(
        "--assume-dim0",
        action="store_true",
        help="rank files without a 'sharding' entry: read every parameter as sharded on dim 0 "
        "(needed where a parameter's shards are the same shape on every rank)",
    )
    parser.add_argument("--dry-run", action="store_true", help="read and check; write nothing")
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace an existing --full file, or an --out directory that holds only what "
        "--format writes there (rank*.pt files; DCP's .metadata and __<r>_0.distcp files); "
        "never a SOURCE, a path inside one or a directory holding one",
    )
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: for states of 256 MiB or more on a terminal)",
    )
    return parser


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_size(text: str) -> int:
    """`--max-memory`'s value in bytes: `512M`, `2G`, `1.5k` or a plain number."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, flags=re.IGNORECASE)
    if found is None or float(found.group(1)) * _UNITS[found.group(2).upper()] < 1:
        raise argparse.ArgumentTypeError(f"must be a size such as 512M or 2G, got {text!r}")
    return int(float(found.group(1)) * _UNITS[found.group(2).upper()])


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text!r}")
    return value


_MAX_WORLD_SIZE = 2**20  # a bound far above any FSDP job, below what a rank's index holds


def _world_size(text: str) -> int:
    value = _positive_int(text)
    if value > _MAX_WORLD_SIZE:
        raise argparse.ArgumentTypeError(f"must be at most {_MAX_WORLD_SIZE}, got {text!r}")
    return value


def _usage_error(args: argparse.Namespace) -> str | None:
    """The message for an impossible option set, or None."""
    if args.out is not None and args.world_size is None:
        return "--out needs --world-size"
    if args.world_size is not None and args.out is None and not args.dry_run:
        return "--world-size needs --out DIR (or --dry-run)"
    if args.out is None and args.full is None and not args.dry_run:
        return "nothing to do: give --world-size N --out DIR, --full FILE or --dry-run"
    if args.format == "dcp" and (args.out is None or args.full is not None or args.dry_run):
        return "--format dcp writes --out DIR only: give -n N -o DIR, without --full or --dry-run"
    dcp_source = is_dcp_source(args.sources)
    if args.format == "dcp" and not dcp_source:
        return "--format dcp needs one DCP checkpoint directory as SOURCE"
    if args.max_memory is not None and (
        not dcp_source or (args.out is not None and args.format != "dcp") or args.dry_run
    ):
        return (
            "--max-memory applies to --full and --format dcp from a DCP checkpoint "
            "(rank files and --dry-run hold the whole optimizer state)"
        )
    if args.workers is not None and (
        not dcp_source or args.dry_run or (args.format != "dcp" and args.full is None)
    ):
        return (
            "--workers applies to --full and --format dcp from a DCP checkpoint "
            "(rank files and --dry-run are written in one process)"
        )
    return None
