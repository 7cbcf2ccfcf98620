"""List and prune the CUDA fatbins inside an ELF shared library (its ``.nv_fatbin`` section).

    python fatbin.py stats LIB.so
    python fatbin.py prune LIB.so OUT.so --keep sm_90 [--keep-ptx]

Pruning keeps the ELF layout byte for byte (no section moves, no relocation changes): in every
fatbin blob the kept entries move to the front, the blob header's fat size shrinks to cover only
them, and the freed tail is zero-filled, so the file compresses to almost nothing there.  The
CUDA runtime (and ``cuobjdump``) walk a blob by its header's fat size and never see the dropped
entries.  ``--keep sm_90`` keeps the cubins of compute capability 9.0 (``sm_90`` and ``sm_90a``).
"""

from __future__ import annotations

import argparse
import struct
from collections import Counter
from collections.abc import Iterator

MAGIC = 0xBA55ED50
BLOB_HEADER = struct.Struct("<IHHQ")  # magic, version, header size, fat size
ELF_KIND, PTX_KIND = 2, 1
Entry = tuple[int, int, int, int]
"""(offset, size with its header, kind, architecture) of one fatbin entry."""


def find_section(data: bytes, name: str) -> tuple[int, int]:
    """(offset, size) of section ``name`` of a 64-bit little-endian ELF."""
    (table,) = struct.unpack_from("<Q", data, 0x28)
    entry_size, count, names_index = struct.unpack_from("<HHH", data, 0x3A)

    def header(index: int) -> tuple:
        return struct.unpack_from("<IIQQQQIIQQ", data, table + index * entry_size)

    names = header(names_index)[4]
    for index in range(count):
        section = header(index)
        start = names + section[0]
        if data[start : data.index(b"\0", start)].decode() == name:
            return section[4], section[5]
    raise SystemExit(f"no section {name}")


def blobs(data: bytes, start: int, end: int) -> Iterator[tuple[int, int, int, list[Entry]]]:
    """(offset, header size, fat size, entries) of each fatbin blob between ``start`` and ``end``."""
    offset = start
    while offset + BLOB_HEADER.size <= end:
        magic, _version, header_size, fat_size = BLOB_HEADER.unpack_from(data, offset)
        if magic != MAGIC:  # blobs are 8- or 16-byte aligned: skip the padding
            offset += 8
            continue
        entries = []
        entry, stop = offset + header_size, offset + header_size + fat_size
        while entry < stop:
            kind, _, entry_header, padded = struct.unpack_from("<HHIQ", data, entry)
            (arch,) = struct.unpack_from("<I", data, entry + 28)
            entries.append((entry, entry_header + padded, kind, arch))
            entry += entry_header + padded
        yield offset, header_size, fat_size, entries
        offset = stop


def stats(path: str) -> None:
    data = open(path, "rb").read()
    start, size = find_section(data, ".nv_fatbin")
    sizes: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    found = 0
    for _, _, _, entries in blobs(data, start, start + size):
        found += 1
        for _, entry_size, kind, arch in entries:
            name = f"{'ptx' if kind == PTX_KIND else 'elf'}_sm_{arch}"
            sizes[name] += entry_size
            counts[name] += 1
    print(f".nv_fatbin {size / 2**20:.1f} MiB in {found} blobs")
    for name in sorted(sizes):
        print(f"  {name:12s} {counts[name]:5d} entries {sizes[name] / 2**20:8.1f} MiB")


def prune(path: str, out: str, keep: set[int], keep_ptx: bool) -> None:
    """Write ``path`` to ``out`` with only the cubins of the architectures ``keep`` (and PTX with
    ``keep_ptx``) in each blob; a blob holding none of them is kept whole."""
    data = bytearray(open(path, "rb").read())
    start, size = find_section(data, ".nv_fatbin")
    kept = dropped = whole = 0
    for offset, header_size, fat_size, entries in list(blobs(data, start, start + size)):
        chosen = [e for e in entries if (e[2] == ELF_KIND and e[3] in keep) or (keep_ptx and e[2] == PTX_KIND)]
        if entries and not chosen:
            whole += 1
            chosen = entries
        body = b"".join(bytes(data[entry : entry + entry_size]) for entry, entry_size, _, _ in chosen)
        data[offset + header_size : offset + header_size + fat_size] = body + b"\0" * (fat_size - len(body))
        struct.pack_into("<Q", data, offset + 8, len(body))
        kept += len(body)
        dropped += fat_size - len(body)
    open(out, "wb").write(data)
    print(
        f"kept {kept / 2**20:.1f} MiB of fatbin entries, zeroed {dropped / 2**20:.1f} MiB; "
        f"{whole} blobs had no kept arch and were left whole"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["stats", "prune"])
    parser.add_argument("library")
    parser.add_argument("out", nargs="?")
    parser.add_argument("--keep", action="append", default=[], help="sm_NN (its a/f variants included)")
    parser.add_argument("--keep-ptx", action="store_true")
    args = parser.parse_args()
    if args.command == "stats":
        stats(args.library)
    else:
        prune(args.library, args.out, {int(name.split("_")[1].rstrip("af")) for name in args.keep}, args.keep_ptx)


if __name__ == "__main__":
    main()
