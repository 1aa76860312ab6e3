"""The environment the tests run in is the locked one: every package of the lock that matches the
installed torch build (requirements/cpu.lock for a CPU torch, cuda.lock otherwise) is installed at
exactly its locked version, so a fresh clone gets what CI got."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

REQUIREMENTS = Path(__file__).resolve().parent.parent / "requirements"


def load_check_lock():
    spec = importlib.util.spec_from_file_location("check_lock", REQUIREMENTS / "check_lock.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def test_installed_versions_equal_the_lock():
    check_lock = load_check_lock()
    lock = REQUIREMENTS / ("cuda.lock" if torch.version.cuda else "cpu.lock")
    packages = check_lock.compare(lock)
    assert len(packages) > 50 and any(p.name == "torch" for p in packages)
    wrong = [f"{p.name}: locked {p.locked}, installed {p.installed}" for p in packages if not p.matches]
    assert not wrong, f"not the locked environment (pip install -r {lock} -e '.[test]'):\n" + "\n".join(wrong)


def test_the_lock_reads_markers_and_pins(tmp_path):
    check_lock = load_check_lock()
    lock = tmp_path / "x.lock"
    lock.write_text("# header\nfoo-bar==1.2  # via x\n    # via y\nold==0.1 ; python_version < '3.0'\nbaz[extra]==3\n")
    assert check_lock.read_lock(lock) == {"foo-bar": "1.2", "baz": "3"}
