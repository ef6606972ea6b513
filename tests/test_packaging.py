"""Packaging: an installed (non-editable) wheel carries the shipped Helion configs and uses them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The project built as a wheel and installed (no deps) into a fresh target directory."""
    tmp = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp),
                    str(ROOT)], check=True, cwd=tmp)
    (wheel,) = tmp.glob("flce_dist-*.whl")
    target = tmp / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, cwd=tmp)
    return target


def test_wheel_ships_and_uses_the_kernel_configs(installed):
    code = (
        "import json, flce_dist\n"
        "from flce_dist.kernels import launch\n"
        "print(json.dumps({'pkg': flce_dist.__file__, 'dir': str(launch.DEFAULT_CONFIG_DIR),"
        " 'h200': launch.load_configs('h200')}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(installed)}
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=installed,
                         env=env).stdout
    got = json.loads(out.strip().splitlines()[-1])
    assert got["pkg"].startswith(str(installed)), got["pkg"]  # the installed copy, not the checkout
    assert got["dir"].startswith(str(installed)), got["dir"]
    shipped = json.loads((ROOT / "flce_dist" / "configs" / "helion" / "h200.json").read_text())
    assert got["h200"] == shipped  # the shipped file, not DEFAULTS


def test_library_requires_ranges_not_the_cpu_pins():
    import tomllib

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = {d.split(">")[0].split("=")[0].split("<")[0].strip(): d for d in meta["dependencies"]}
    assert "==" not in deps["torch"] and "==" not in deps["helion"], deps
    assert "tqdm" not in deps and "rich" not in deps  # used by launch/ only
    pins = (ROOT / "constraints-cpu.txt").read_text()
    assert "torch==2.13.0" in pins and "helion==1.4.0" in pins
