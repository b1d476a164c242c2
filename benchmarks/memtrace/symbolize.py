"""Name the frames of stripped libraries in heaptrack_print's output (grpcio's cygrpc above all).

    heaptrack_print -f DIR/scheduler.zst -l 1 -p 0 -a 0 -T 0 -s 40 \\
        | python benchmarks/memtrace/symbolize.py DIR/scheduler.zst

grpcio's wheel ships ``cygrpc.*.so`` without a symbol table, so heaptrack prints its frames as
bare addresses (``0x7f65a769b100`` / ``in .../cygrpc...so``). This names them well enough to
tell the stacks apart:

- the library's load address is not in heaptrack's file, but every frame above the first is a
  return address less one, so the page-aligned base that puts the most of the library's
  addresses right after a call instruction is the one (it stands out: 2,295 of 2,319 frames
  against at most 72 for any other base);
- the function around an address comes from the library's unwind table (``readelf -wf``);
- its name from the strings its code refers to (``objdump -d``): a Cython function refers to
  its qualified name for tracebacks (``grpc._cython.cygrpc._BatchOperationTag.prepare``), a
  generator body to its .pyx source and function name, gRPC core to its source file.

Each bare address line gets ``off=<offset in the library>`` and those strings appended; other
lines pass through. Needs zstd, readelf and objdump (binutils).
"""

from __future__ import annotations

import bisect
import functools
import re
import subprocess
import sys

ADDRESS = re.compile(r"^(\s*)0x([0-9a-f]+)\s*$")
MODULE = re.compile(r"^\s*in (/\S+)\s*$")


def frames_by_module(heaptrack_file: str, modules: set[str]) -> dict[str, list[int]]:
    """The instruction pointers heaptrack recorded in each of ``modules`` (its "s" lines are
    the string table, "i" lines ``i <ip> <module string index> ...``)."""
    text = subprocess.run(["zstd", "-dc", heaptrack_file], capture_output=True, check=True).stdout
    strings, index, ips = [None], {}, {m: [] for m in modules}
    for line in text.decode(errors="replace").splitlines():
        if line.startswith("s "):
            strings.append(line[2:].partition(" ")[2])
            if strings[-1] in modules:
                index[len(strings) - 1] = strings[-1]
        elif line.startswith("i "):
            parts = line.split()
            module = index.get(int(parts[2], 16))
            if module is not None:
                ips[module].append(int(parts[1], 16))
    return ips


def _after_call(data: bytes, off: int) -> bool:
    """Whether the bytes before ``off`` end with an x86-64 call instruction."""
    if not 7 <= off < len(data):
        return False
    b = data
    return (b[off - 5] == 0xE8                                                # call rel32
            or (b[off - 6] == 0xFF and b[off - 5] == 0x15)                    # call [rip+disp32]
            or (b[off - 2] == 0xFF and 0xD0 <= b[off - 1] <= 0xD7)            # call reg
            or (b[off - 3] == 0x41 and b[off - 2] == 0xFF and 0xD0 <= b[off - 1] <= 0xD7)
            or (b[off - 3] == 0xFF and 0x50 <= b[off - 2] <= 0x57)            # call [reg+disp8]
            or (b[off - 6] == 0xFF and 0x90 <= b[off - 5] <= 0x97)            # call [reg+disp32]
            or (b[off - 4] == 0x41 and b[off - 3] == 0xFF and 0x50 <= b[off - 2] <= 0x57)
            or (b[off - 4] == 0xFF and b[off - 3] == 0x54))                   # call [sib+disp8]


def load_base(data: bytes, ips: list[int]) -> int:
    lo, hi = max(ips) - len(data), min(ips)
    best = max(range(lo // 4096 * 4096, hi + 1, 4096),
               key=lambda base: sum(_after_call(data, ip - base + 1) for ip in ips))
    return best


class Library:
    def __init__(self, path: str, ips: list[int]) -> None:
        self.path = path
        with open(path, "rb") as f:
            self.data = f.read()
        self.base = load_base(self.data, ips)
        frames = subprocess.run(["readelf", "-wf", path], capture_output=True, text=True).stdout
        self.functions = sorted((int(a, 16), int(b, 16)) for a, b in re.findall(r"pc=([0-9a-f]+)\.\.([0-9a-f]+)", frames))
        self.starts = [a for a, _ in self.functions]

    def describe(self, ip: int) -> str:
        off = ip - self.base
        i = bisect.bisect_right(self.starts, off) - 1
        if i < 0 or not self.functions[i][0] <= off < self.functions[i][1]:
            return f"off={off:#x} (no function)"
        return f"off={off:#x} {self._names(self.functions[i])}"

    @functools.lru_cache(maxsize=None)
    def _names(self, function: tuple[int, int]) -> str:
        code = subprocess.run(["objdump", "-d", "--no-show-raw-insn", f"--start-address={function[0]}",
                               f"--stop-address={function[1]}", self.path], capture_output=True, text=True).stdout
        found = []
        for ref in re.findall(r"#\s*([0-9a-f]+)\s", code):
            start = int(ref, 16)
            end = self.data.find(b"\0", start, start + 200)
            text = self.data[start:end] if start < len(self.data) and end > start else b""
            if len(text) >= 6 and all(32 <= c < 127 for c in text):
                found.append(text.decode())
        cython = [s for s in found if s.startswith("grpc._cython")]
        sources = [s for s in found if s.endswith((".pyx.pxi", ".cc", ".h"))]
        pick = cython[:1] or sources[:1] + [s for s in found if s.isidentifier()][:1] or found[:2]
        return " | ".join(dict.fromkeys(pick)) or "?"


def main(heaptrack_file: str) -> None:
    lines = sys.stdin.read().splitlines()
    stripped = {m.group(1) for prev, line in zip(lines, lines[1:])
                if ADDRESS.match(prev) and (m := MODULE.match(line))}
    libraries = {path: Library(path, ips) for path, ips in frames_by_module(heaptrack_file, stripped).items() if ips}
    for i, line in enumerate(lines):
        address = ADDRESS.match(line)
        module = MODULE.match(lines[i + 1]) if address and i + 1 < len(lines) else None
        if module and module.group(1) in libraries:
            print(f"{line.rstrip()} {libraries[module.group(1)].describe(int(address.group(2), 16))}")
        else:
            print(line)


if __name__ == "__main__":
    main(sys.argv[1])
