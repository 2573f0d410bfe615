"""The environment is read in one place per language: python/hopper_moe/settings.py (once, at
import) and csrc/settings.cpp. A read anywhere else under python/ or csrc/ fails this test
with its file:line, so that no per-call path depends on when a variable was set."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("python", "csrc")
ALLOWED = {"python/hopper_moe/settings.py", "csrc/settings.cpp"}
SUFFIXES = {".py", ".c", ".cc", ".cpp", ".cu", ".cuh", ".h", ".hpp"}
# getenv / secure_getenv / std::getenv / os.getenv, os.environ, and any environ.get.
READ = re.compile(r"getenv|os\.environ|environ\.get")


def _sources():
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*")):
            if path.is_file() and path.suffix in SUFFIXES:
                yield path


def env_reads() -> list[str]:
    """``file:line: text`` of every environment read outside the allowed files."""
    found = []
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        if rel in ALLOWED:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), 1):
            if READ.search(line):
                found.append(f"{rel}:{number}: {line.strip()}")
    return found


def test_scanned_folders_exist():
    assert all((ROOT / top).is_dir() for top in SCANNED)
    assert (ROOT / "python/hopper_moe/settings.py").is_file()


def test_environment_is_read_only_in_settings():
    reads = env_reads()
    assert not reads, ("environment read outside python/hopper_moe/settings.py and "
                       "csrc/settings.cpp (read it there once and use the constant):\n"
                       + "\n".join(reads))


def test_the_pattern_catches_each_form():
    for line in ('x = os.environ.get("A")', 'os.getenv("A")', 'const char* e = std::getenv("A");',
                 'v = os.environ["A"]', "environ.get('A')"):
        assert READ.search(line), line
