#!/usr/bin/env python3
"""Check that the built k2_kernels._C carries CUDA kernels compiled for sm_90a.

CI runs this after `make test` (`.ci/run`). No GPU and no cuobjdump needed: the script reads
the extension's ELF sections, finds `.nv_fatbin`, walks the fat binaries in it and lists their
entries (kind, SM arch, the `a` arch-specific flag), then checks that a cubin (not just PTX) for
the wanted arch holds every k2 kernel. Exit status 0 when all checks pass, 1 otherwise.

    python scripts/check_cuda_build.py [--so PATH] [--arch 90a]

Fat binary layout (as written by nvcc 12/13's `fatbinary`, checked against `nvcc -fatbin`
outputs for sm_80, sm_90 and sm_90a): a 16-byte header (magic 0xBA55ED50, u16 version,
u16 header size, u64 size of the entries), then entries, each with a header of
u16 kind (1 PTX, 2 ELF cubin), u16 version, u32 header size, u64 payload size, ...,
u32 SM arch at +0x1c, u64 flags at +0x28 (0x100000 marks an arch-specific `a` target).
"""

from __future__ import annotations

import argparse
import importlib.util
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

FATBIN_MAGIC = 0xBA55ED50
KIND_PTX, KIND_ELF = 1, 2
FLAG_ARCH_SPECIFIC = 0x100000
FLAG_COMPRESSED = 0x2000 | 0x8000  # either bit: payload compressed (names not greppable)
KERNELS = (
    "route_kernel",
    "hist_kernel",
    "scan_kernel",
    "place_kernel",
    "gather_kernel",
    "unpermute_kernel",
    "unpermute_backward_kernel",
    # MLA attention (csrc/cuda/mla_attention_*.cu)
    "fwd_mma_kernel",
    "bwd_mma_kernel",
    "fwd_simt_kernel",
    "bwd_simt_kernel",
    "delta_kernel",
    "convert_kernel",
    "fill_kernel",
    # Newton-Schulz (csrc/cuda/newton_schulz.cu)
    "ns_gemm_bf16",
    "ns_gemm_f32",
)


@dataclass
class Entry:
    kind: int
    arch: int
    flags: int
    payload: bytes

    @property
    def name(self) -> str:
        suffix = "a" if self.flags & FLAG_ARCH_SPECIFIC else ""
        return f"{'sm' if self.kind == KIND_ELF else 'compute'}_{self.arch}{suffix}"


def elf_section(data: bytes, wanted: str) -> bytes | None:
    """The contents of the named section of a 64-bit little-endian ELF file."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)

    def header(i: int) -> tuple[int, int, int, int]:
        name, _type, _flags, _addr, offset, size = struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize)
        return name, _type, offset, size

    _, _, str_off, _ = header(shstrndx)
    for i in range(shnum):
        name_off, sh_type, offset, size = header(i)
        end = data.index(b"\0", str_off + name_off)
        if data[str_off + name_off : end].decode() == wanted:
            return b"" if sh_type == 8 else data[offset : offset + size]  # SHT_NOBITS
    return None


def fatbin_entries(section: bytes) -> list[Entry]:
    """Every entry of every fat binary in a `.nv_fatbin` section (blobs are 8-byte aligned)."""
    entries, off = [], 0
    while off + 16 <= len(section):
        magic, _version, hsize, size = struct.unpack_from("<IHHQ", section, off)
        if magic != FATBIN_MAGIC:
            off += 8
            continue
        pos, end = off + hsize, off + hsize + size
        while pos + 0x30 <= end:
            kind, _v, ehsize, psize = struct.unpack_from("<HHIQ", section, pos)
            if ehsize == 0:
                break
            (arch,) = struct.unpack_from("<I", section, pos + 0x1C)
            (flags,) = struct.unpack_from("<Q", section, pos + 0x28)
            entries.append(Entry(kind, arch, flags, section[pos + ehsize : pos + ehsize + psize]))
            pos += ehsize + psize
        off = max(end, off + 8)
    return entries


def find_extension() -> Path:
    spec = importlib.util.find_spec("k2_kernels._C")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "k2_kernels._C is not installed (build it: pip install -e packages/k2-kernels)"
        )
    return Path(spec.origin)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--so", type=Path, help="extension file to check (default: the installed k2_kernels._C)")
    ap.add_argument("--arch", default="90a", help="required cubin arch, e.g. 90a (default) or 90")
    args = ap.parse_args(argv)
    want_arch = int(args.arch.rstrip("a"))
    want_specific = args.arch.endswith("a")
    errors: list[str] = []

    so = args.so or find_extension()
    print(f"extension: {so}")
    if args.so is None:
        import k2_kernels._C as C

        print(f"with_cuda={C.with_cuda} cuda_archs={getattr(C, 'cuda_archs', '?')!r}")
        if not C.with_cuda:
            errors.append("k2_kernels._C was built without CUDA (set K2_CUDA=ON with nvcc on PATH)")
        if not hasattr(C, "moe_route_cuda"):
            errors.append("k2_kernels._C has no CUDA entry points (moe_route_cuda missing)")

    section = elf_section(so.read_bytes(), ".nv_fatbin")
    if section is None:
        errors.append(f"{so.name} has no .nv_fatbin section: no device code embedded")
        entries = []
    else:
        entries = fatbin_entries(section)
    print(f"fatbin entries: {', '.join(e.name for e in entries) or 'none'}")
    cubins = [
        e
        for e in entries
        if e.kind == KIND_ELF and e.arch == want_arch and bool(e.flags & FLAG_ARCH_SPECIFIC) == want_specific
    ]
    if not cubins:
        errors.append(f"no sm_{args.arch} cubin embedded (found: {[e.name for e in entries]})")
    else:
        blob = b"".join(e.payload for e in cubins if not e.flags & FLAG_COMPRESSED)
        missing = [k for k in KERNELS if k.encode() not in blob]
        if blob and missing:
            errors.append(f"sm_{args.arch} cubins lack kernels: {missing}")
        elif not blob:
            print("note: cubins are compressed; kernel names not checked")
        else:
            print(f"sm_{args.arch} cubins hold: {', '.join(KERNELS)}")
    for e in errors:
        print(f"FAIL: {e}", file=sys.stderr)
    if not errors:
        print(f"OK: k2_kernels._C carries sm_{args.arch} device code for every k2 CUDA kernel")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
