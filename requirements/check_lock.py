"""Compares the installed distributions with a lock file and prints them.

    python requirements/check_lock.py [requirements/cpu.lock]

Exit 0 when every locked package is installed at its locked version, 1 otherwise (each
difference printed, with the command that fixes it). .ci/run prints this before the tests;
tests/test_locked_environment.py asserts the same.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

DEFAULT_LOCK = Path(__file__).resolve().parent / "cpu.lock"


@dataclass(frozen=True)
class LockedPackage:
    name: str
    locked: str
    installed: str | None  # None: not installed

    @property
    def matches(self) -> bool:
        return self.installed == self.locked


def read_lock(lock: Path) -> dict[str, str]:
    """name -> version for every `name==version` line of a pip-format lock whose marker holds here."""
    pins = {}
    for line in lock.read_text().splitlines():
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith(("#", "-")):
            continue
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue  # e.g. a backport this Python does not need
        [pin] = requirement.specifier
        pins[normalise(requirement.name)] = pin.version
    return pins


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def compare(lock: Path) -> list[LockedPackage]:
    # The first distribution of a name on sys.path is the one an import loads; later ones are copies
    # another package vendors (setuptools puts its _vendor folder, with e.g. platformdirs, on sys.path).
    installed: dict[str, str] = {}
    for distribution in metadata.distributions():
        installed.setdefault(normalise(distribution.metadata["Name"]), distribution.version)
    return [LockedPackage(name, version, installed.get(name)) for name, version in sorted(read_lock(lock).items())]


def main(argv: list[str]) -> int:
    lock = Path(argv[0]) if argv else DEFAULT_LOCK
    packages = compare(lock)
    wrong = [p for p in packages if not p.matches]
    for p in wrong:
        print(f"  {p.name}: locked {p.locked}, installed {p.installed or 'nothing'}")
    if wrong:
        print(f"{len(wrong)} of {len(packages)} packages differ from {lock.name}: pip install -r {lock} -e '.[test]'")
        return 1
    print(
        f"{len(packages)} packages installed at the versions of {lock.name}: "
        + ", ".join(f"{p.name} {p.installed}" for p in packages)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
