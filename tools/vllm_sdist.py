"""Download vLLM's source distribution from PyPI, hash checked: python tools/vllm_sdist.py DEST VERSION

`pip download --no-binary :all: vllm==...` would also build vLLM's build requirements from source
to prepare its metadata; the tarball is fetched from the same index (pip's simple index, JSON)
directly, and its sha256 compared with the index's. Written to DEST.tmp, then renamed, so an
interrupted download never leaves a DEST behind. Used by tools/vllm_kernel_tests.sh and
tools/vllm_offline_bundle.sh.
"""
import hashlib
import json
import os
import sys
import urllib.request


def main(dest: str, version: str) -> int:
    req = urllib.request.Request("https://pypi.org/simple/vllm/",
                                 headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    files = json.load(urllib.request.urlopen(req, timeout=120))["files"]
    entry = next(f for f in files if f["filename"] == f"vllm-{version}.tar.gz")
    data = urllib.request.urlopen(entry["url"], timeout=600).read()
    digest = hashlib.sha256(data).hexdigest()
    if digest != entry["hashes"]["sha256"]:
        sys.exit(f"sha256 mismatch: {digest} != {entry['hashes']['sha256']}")
    with open(dest + ".tmp", "wb") as f:
        f.write(data)
    os.replace(dest + ".tmp", dest)
    print(f"{entry['filename']} sha256 {digest}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__.splitlines()[0])
    sys.exit(main(sys.argv[1], sys.argv[2]))
