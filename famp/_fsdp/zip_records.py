"""The zip records of a `torch.save` file: CRC-32s set where torch sets them, and its id.

`torch_save_writer.py` fills the records of a `torch.save` file written with their bytes
skipped, so it sets what torch's writer derives from those bytes:

* each record's CRC-32, in the data descriptor after its bytes (torch's writer leaves the local
  header's field 0 and sets flag 0x08) and in the central directory;
* the `.data/serialization_id` record: 20 digits of a hash of the record names, then 20 digits
  of torch's `hash_combine` folded over the other records' CRC-32s in file order, those with a
  data descriptor (what torch's `PyTorchStreamWriter` computes while it writes them). That
  rule is checked once against the installed torch, on a file it writes; where it does not
  hold, the id is left as written.
"""

from __future__ import annotations

import functools
import io
import struct
import zipfile
import zlib
from typing import Any

import torch

_ID = ".data/serialization_id"
_MASK = 2**64 - 1


def set_crcs(f: Any, zf: zipfile.ZipFile, crcs: dict[str, int]) -> None:
    """Write each record's CRC-32 where `torch.save` puts it: the data descriptor after its
    bytes (local header flag 0x08), else the local header; and the central directory entry."""
    for info in zf.infolist():
        if info.filename in crcs:
            f.seek(info.header_offset)
            local = f.read(30)
            flags = struct.unpack("<H", local[6:8])[0]
            name_len, extra_len = struct.unpack("<HH", local[26:30])
            where = info.header_offset + 14
            if flags & 0x08:
                descriptor = info.header_offset + 30 + name_len + extra_len + info.compress_size
                f.seek(descriptor)
                if f.read(4) != b"PK\x07\x08":
                    raise AssertionError(f"record {info.filename}: no zip data descriptor")
                where = descriptor + 4
            f.seek(where)
            f.write(struct.pack("<I", crcs[info.filename]))
    f.seek(zf.start_dir)
    for info in zf.infolist():
        entry = f.tell()
        header = f.read(46)
        if header[:4] != b"PK\x01\x02":
            raise AssertionError("unexpected zip central directory")
        name_len, extra_len, comment_len = struct.unpack("<HHH", header[28:34])
        if info.filename in crcs:
            f.seek(entry + 16)
            f.write(struct.pack("<I", crcs[info.filename]))
        f.seek(entry + 46 + name_len + extra_len + comment_len)


def _data_offset(f: Any, info: zipfile.ZipInfo) -> int:
    f.seek(info.header_offset + 26)
    name_len, extra_len = struct.unpack("<HH", f.read(4))
    return int(info.header_offset + 30 + name_len + extra_len)


def _combined(zf: zipfile.ZipFile, crcs: dict[str, int]) -> int:
    """torch's `hash_combine` folded over the CRC-32s of the records but the id, in file order,
    that have a data descriptor (torch's writer combines each as it writes it; a record of no
    bytes has none)."""
    combined = 0
    for info in sorted(zf.infolist(), key=lambda i: i.header_offset):
        if info.flag_bits & 0x08 and not info.filename.endswith("/" + _ID):
            value = crcs.get(info.filename, info.CRC)
            combined ^= (value + 0x9E3779B9 + ((combined << 6) & _MASK) + (combined >> 2)) & _MASK
    return combined


@functools.cache
def _rule_holds() -> bool:
    """Whether the installed torch's serialization id follows `_combined`, on a file it writes."""
    buffer = io.BytesIO()
    torch.save({"probe": torch.arange(3.0), "none": torch.zeros(0), "n": 2}, buffer)
    with zipfile.ZipFile(buffer) as zf:
        ids = [n for n in zf.namelist() if n.endswith("/" + _ID)]
        if len(ids) != 1:
            return False
        written = zf.read(ids[0])
        return len(written) == 40 and written[20:] == b"%020d" % _combined(zf, {})


def set_serialization_id(path: str, crcs: dict[str, int]) -> None:
    """Set the id of the `torch.save` file `path` from its records' CRC-32s (`crcs` where they
    differ from the central directory's), and its CRC-32, as torch sets them."""
    if not _rule_holds():
        return
    with open(path, "r+b") as f, zipfile.ZipFile(path) as zf:
        info = next((i for i in zf.infolist() if i.filename.endswith("/" + _ID)), None)
        if info is None or info.file_size != 40:
            return
        start = _data_offset(f, info)
        f.seek(start + 20)
        digits = b"%020d" % _combined(zf, crcs)
        f.write(digits)
        f.seek(start)
        new = f.read(40)
        set_crcs(f, zf, {info.filename: zlib.crc32(new)})
