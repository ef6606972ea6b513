"""Packaging: ``python -m build`` makes a wheel and an sdist that install into a fresh venv and run there with
their shipped Helion configs; the declared ranges, the version's one place, helion 1.5 on torch 2.11."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> dict[str, Path]:
    """``python -m build``: the sdist, then the wheel built from that sdist (build's default order), without
    build isolation (offline: the running environment's setuptools builds them)."""
    pytest.importorskip("build", reason="python -m build needs the 'build' package (the dev extra)")
    out = tmp_path_factory.mktemp("dist")
    r = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
                       capture_output=True, text=True, cwd=out)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    (sdist,) = out.glob("flce_dist-*.tar.gz")
    (wheel,) = out.glob("flce_dist-*.whl")
    return {"sdist": sdist, "wheel": wheel}


def test_sdist_holds_the_package_data_and_license(dists):
    import tarfile

    with tarfile.open(dists["sdist"]) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    shipped = {str(p.relative_to(ROOT)) for p in (ROOT / "flce_dist" / "configs" / "helion").glob("*.json")}
    assert shipped and shipped <= names, shipped - names
    assert {"LICENSE", "README.md", "pyproject.toml", "flce_dist/py.typed", "flce_dist/__init__.py"} <= names


# In the fresh venv: the installed copy (not this checkout), its version, its shipped configs, py.typed, the
# license in its metadata, and one fused loss call with gradients in Helion's reference mode.
_SMOKE = """
import importlib.metadata as md, json, pathlib, sys
import torch
import flce_dist
from flce_dist.kernels import launch

torch.set_num_threads(1)
flce_dist.setup_reference_mode()
torch.manual_seed(0)
n, h, v = 37, 24, 101
x = torch.randn(n, h, requires_grad=True)
w = (0.1 * torch.randn(v, h)).requires_grad_()
t = torch.randint(0, v, (n,))
t[3] = -100
loss = flce_dist.fused_linear_cross_entropy(x, w, t)
loss.backward()
ref = flce_dist.reference_loss(x.detach().double(), w.detach().double(), t)
files = [str(f) for f in md.files("flce_dist")]
print(json.dumps({
    "prefix": sys.prefix, "pkg": flce_dist.__file__, "config_dir": str(launch.DEFAULT_CONFIG_DIR),
    "h200": launch.load_configs("h200"), "version": flce_dist.__version__, "meta_version": md.version("flce_dist"),
    "license": md.metadata("flce_dist").get("License-Expression"), "license_file": any(f.endswith("LICENSE") for f in files),
    "typed": (pathlib.Path(flce_dist.__file__).parent / "py.typed").is_file(),
    "loss": loss.item(), "ref": ref.item(),
    "grads_finite": bool(x.grad.isfinite().all() and w.grad.isfinite().all()),
}))
"""


def _fresh_venv(path: Path) -> Path:
    """A new venv without pip that sees this environment's packages (torch, helion) behind its own
    site-packages through a ``.pth`` line: the installed flce_dist is the venv's, nothing is downloaded. (The
    ``.pth`` adds the directory only: an editable flce_dist of this environment, a finder that its own ``.pth``
    installs, stays out.)"""
    import sysconfig
    import venv

    venv.EnvBuilder(with_pip=False).create(path)
    py = path / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    parent = dict.fromkeys((sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]))
    (Path(site) / "_flce_test_parent_env.pth").write_text("".join(f"{p}\n" for p in parent))
    return py


@pytest.mark.parametrize("kind", ["wheel", "sdist"])
def test_built_dist_installs_into_a_fresh_venv_and_runs(dists, kind, tmp_path):
    """``python -m build``'s wheel and sdist each install (``pip --no-deps --no-index``; the sdist built by pip
    from source) into a fresh venv, where a fused loss call matches the float64 reference, with the configs,
    ``py.typed``, the version and the license of the installed copy."""
    py = _fresh_venv(tmp_path / "venv")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HELION_INTERPRET")}
    # --ignore-installed: a flce_dist of the parent environment (CI job 2 installs the wheel there) is visible
    # through the .pth and would make pip skip the install as "already satisfied".
    env["PIP_CONSTRAINT"] = "/dev/null"  # this machine's global pip constraints cap torch; nothing is resolved here
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", "--no-index",
                        "--ignore-installed", "--no-build-isolation", str(dists[kind])], capture_output=True, text=True, cwd=tmp_path,
                       env=env)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    r = subprocess.run([str(py), "-c", _SMOKE], capture_output=True, text=True, cwd=tmp_path,
                       env=env | {"OMP_NUM_THREADS": "1"}, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    venv_dir = str(tmp_path / "venv")
    assert got["prefix"] == venv_dir and got["pkg"].startswith(venv_dir), got["pkg"]  # the installed copy
    assert got["config_dir"].startswith(venv_dir), got["config_dir"]
    shipped = json.loads((ROOT / "flce_dist" / "configs" / "helion" / "h200.json").read_text())
    assert got["h200"] == shipped  # the shipped file, not launch.DEFAULTS
    assert got["version"] == got["meta_version"] == _source_version()
    assert got["license"] == "BSD-3-Clause" and got["license_file"], got
    assert got["typed"]
    assert got["grads_finite"] and abs(got["loss"] - got["ref"]) <= 1e-5 * abs(got["ref"]), got


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
