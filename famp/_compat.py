"""Every private torch name famp uses, in one place, each with the reason it is needed.

famp follows the installed torch: public API wherever torch has one. Where it has none, the private
name is imported here, and only here, so that a torch upgrade that moves it breaks one module (and
the tests that pin it across the supported window), never a user's numbers.
"""

from __future__ import annotations

# --- checkpoints (famp/_dcp_writer.py) -------------------------------------------------------


def dcp_storage_info(relative_path: str, offset: int, length: int) -> object:
    """DCP's per-item storage record, for a ``.metadata`` that ``dcp.load`` reads.

    ``FileSystemReader`` looks up each item's byte range in ``Metadata.storage_data`` as an
    instance of this class (unpickled by name); torch has no public constructor for it. Imported
    lazily: ``torch.distributed.checkpoint`` is heavy.
    """
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo(relative_path, offset, length)
