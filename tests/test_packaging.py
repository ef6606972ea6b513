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
    # the tested ranges (issue 50): a user's torch 2.14/2.15 and helion 1.5.x are kept, never replaced
    assert deps["torch"].replace(" ", "") == "torch>=2.11,<2.16", deps["torch"]
    assert deps["helion"].replace(" ", "") == "helion>=1.4,<1.6", deps["helion"]
    assert "tqdm" not in deps and "rich" not in deps  # used by launch/ only
    pins = (ROOT / "constraints-cpu.txt").read_text()
    assert "torch==2.13.0" in pins and "helion==1.4.0" in pins
    newest = (ROOT / "constraints-newest.txt").read_text()
    assert "torch==2.15.0" in newest and "helion==1.5.1" in newest


def _source_version() -> str:
    """The version's one place: ``flce_dist/__init__.py``'s ``__version__`` literal (pyproject.toml reads it)."""
    import re

    (version,) = re.findall(r'^__version__ = "([^"]+)"', (ROOT / "flce_dist" / "__init__.py").read_text(), re.M)
    return version


def test_version_has_one_place():
    import tomllib

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in meta["project"] and "version" in meta["project"]["dynamic"], meta["project"]
    assert meta["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "flce_dist.__version__"}
    import flce_dist

    assert flce_dist.__version__ == _source_version()
    # the changelog has an entry for it: "## [0.2.0] - Unreleased" for 0.2.0.dev0, "## [0.2.0] - <date>" once released
    release = _source_version().split(".dev")[0].split("+")[0]
    assert f"## [{release}]" in (ROOT / "CHANGELOG.md").read_text(), release


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    return {d: md.version(d) for d in ("torch", "helion")}


def test_installing_keeps_the_users_torch_and_helion(tmp_path_factory):
    """pip resolves the built wheel's dependencies against this environment (the pinned job's torch 2.13 +
    helion 1.4, the newest job's torch 2.15 + helion 1.5.1) and installs nothing but flce_dist. Offline
    (``--no-index``; this machine's find-links dir holds a torch 2.13.0 wheel that a narrower range would
    pick as a downgrade) and without the machine's torch cap (a user's pip has none)."""
    import shutil

    tmp = tmp_path_factory.mktemp("keep")
    # a copy of the project under a version of its own: an flce_dist already installed here (CI's newest job
    # installs the wheel) would otherwise be "already satisfied" and its dependencies never resolved
    src = tmp / "src"
    shutil.copytree(ROOT / "flce_dist", src / "flce_dist", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("README.md", "LICENSE", "pyproject.toml"):
        shutil.copy(ROOT / name, src / name)
    init = src / "flce_dist" / "__init__.py"
    version = _source_version()
    init.write_text(init.read_text().replace(f'__version__ = "{version}"', f'__version__ = "{version}+keeptest"'))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp),
                    str(src)], check=True, cwd=tmp)
    (wheel,) = tmp.glob("flce_dist-*.whl")
    report = tmp / "report.json"
    env = os.environ | {"PIP_CONSTRAINT": "/dev/null"}
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--report", str(report),
                        str(wheel)], cwd=tmp, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr  # a range excluding the installed torch fails here
    planned = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    assert planned == {"flce_dist": f"{version}+keeptest"}, planned  # nothing else installed: torch and helion kept
    assert _versions() == _versions()  # (read from metadata; the dry run changed nothing)


def test_helion_15_imports_on_a_torch_without_intel_gpu_error():
    """torch 2.11 lacks ``triton_compat.IntelGPUError``, which helion 1.5's logger imports: simulated by
    removing it in a fresh process. flce_dist's import path supplies it (helion >= 1.5 only) and helion
    imports; without that step ``import helion`` 1.5 fails (the control: this test can fail)."""
    helion = _versions()["helion"]
    # torch >= 2.12's own triton_heuristics imports the name too: load it first, then take the name away
    drop = ("import torch._inductor.runtime.triton_heuristics, torch._inductor.runtime.triton_compat as tc\n"
            "if hasattr(tc, 'IntelGPUError'): del tc.IntelGPUError\n")
    with_step = drop + ("from flce_dist import _helion_compat as c\n"
                        "import helion, torch._inductor.runtime.triton_compat as tc\n"
                        "added = hasattr(tc, 'IntelGPUError')\n"
                        "assert not added or issubclass(tc.IntelGPUError, Exception)\n"
                        "print(added, c.helion is helion)\n")
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", with_step], capture_output=True, text=True, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    added, same = out.stdout.split()[-2:]
    assert same == "True"
    assert added == str(tuple(int(p) for p in helion.split(".")[:2]) >= (1, 5)), (helion, out.stdout)
    if added == "True":  # the control, where it applies: helion 1.5 alone on such a torch does not import
        bare = subprocess.run([sys.executable, "-c", drop + "import helion\n"], capture_output=True, text=True,
                              env=env, cwd=ROOT)
        assert bare.returncode != 0 and "IntelGPUError" in bare.stderr, bare.stderr


def test_import_flce_dist_imports_no_helion():
    code = "import sys, flce_dist; print('helion' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env=os.environ | {"PYTHONPATH": str(ROOT)})
    assert out.returncode == 0 and out.stdout.split()[-1] == "False", out.stdout + out.stderr


def test_configs_overlay_per_helion_series(tmp_path):
    """``<arch>@helion<series>.json`` replaces the base file's entries key by key, for that series only."""
    from flce_dist.kernels import launch as L

    base = {"lse_forward": {"bf16": {"config": {"num_warps": 8}}, "bf16@h2304": {"config": {"num_warps": 8}}},
            "merge": {"fp32": {"config": {"num_warps": 4}}}}
    over = {"lse_forward": {"bf16@h2304": {"config": {"num_warps": 4, "num_stages": 4}}}}
    (tmp_path / "h200.json").write_text(json.dumps(base))
    (tmp_path / "h200@helion1.5.json").write_text(json.dumps(over))
    got15 = L.load_configs("h200", str(tmp_path), "1.5")
    assert got15["lse_forward"]["bf16@h2304"] == over["lse_forward"]["bf16@h2304"]
    assert got15["lse_forward"]["bf16"] == base["lse_forward"]["bf16"] and got15["merge"] == base["merge"]
    assert L.load_configs("h200", str(tmp_path), "1.4") == base
    assert [p.name for p in L.config_files("h200", str(tmp_path), "1.5")] == ["h200.json", "h200@helion1.5.json"]
    # the running series' overlay is the one read by default
    series = L.helion_series()
    assert L.load_configs("h200", str(tmp_path)) == (got15 if series == "1.5" else base)
