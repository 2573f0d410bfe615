"""Fail when ptxas reports spills, local memory or a stack frame for any kernel, or
serializes a kernel's wgmma instructions.

Reads a build log made with -Xptxas=-v (setup.py adds it) and prints a summary. Exit 1 if any
kernel spills or uses local memory, or if ptxas reports (C7515) that it serialized the wgmma
of a kernel: every wgmma then waits for its own completion before the next is issued, which a
kernel with one batch in flight cannot afford.

    python tools/check_ptxas.py build/build.log
"""
import re
import sys

FUNC = re.compile(r"Compiling entry function '(\S+)' for '(sm_\w+)'")
STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
USED = re.compile(r"Used (\d+) registers(.*)")
SERIAL = re.compile(r"wgmma\.mma_async instructions are serialized .*in the function '(\S+)'")


def main(path: str) -> int:
    kernels, bad, serialized = 0, [], []
    current = None
    for line in open(path, errors="replace"):
        if m := SERIAL.search(line):
            serialized.append(m.group(1))
            continue
        if m := FUNC.search(line):
            current = m.group(1)
            continue
        if current and (m := STACK.search(line)):
            frame, st, ld = map(int, m.groups())
            if frame or st or ld:
                bad.append(f"{current}: {frame} B stack, {st} B spill stores, {ld} B spill loads")
        elif current and (m := USED.search(line)):
            kernels += 1
            lmem = re.search(r"(\d+) bytes lmem", m.group(2))
            if lmem and int(lmem.group(1)):
                bad.append(f"{current}: {lmem.group(1)} B local memory")
            current = None
    if kernels == 0:
        print("check_ptxas: no kernel was compiled in this build (up to date)")
        return 0
    print(f"check_ptxas: {kernels} kernels, {len(bad)} with spills or local memory, "
          f"{len(serialized)} with serialized wgmma")
    for b in bad:
        print("  SPILL", b)
    for name in serialized:
        print("  SERIALIZED WGMMA", name)
    return 1 if bad or serialized else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "build/build.log"))
