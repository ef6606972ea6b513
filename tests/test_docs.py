"""The README and docs/ stay true: README.md stays short, every relative link resolves, every shell
block marked for running (info string ``bash run``) runs from the repository root and exits 0, every
python block of the README compiles, and the README's two quick-start programs run (one rank, and a
2-rank gloo group under torchrun) in Helion's reference mode.

Only cheap commands (seconds on a 2-core CPU machine, no GPU) are marked ``bash run``; the set-up, the
full test command and GPU/torchrun jobs are shown as plain ``bash`` blocks and not run here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = None

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
MAX_README_LINES = 300
# Commands that must never be marked `bash run` (slow, need a GPU, or run the whole suite).
NOT_RUNNABLE = ("launch/setup.sh", "pytest", "--nproc_per_node", "NGPU=", "device.sh", "train_bench.sh", "nvidia-smi")
# The README's two commands for a fresh machine; .ci/run and launch/setup.sh's users rely on them.
FRESH_MACHINE = (
    "bash launch/setup.sh && .venv/bin/torchrun --nproc_per_node=2 launch/train.py --config configs/train/tiny_cpu.toml",
    ".venv/bin/python -m pytest -q tests",
)

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


class Block:
    def __init__(self, path: Path, line: int, info: str, src: str):
        self.path, self.line, self.info, self.src = path, line, info, src

    @property
    def words(self) -> list[str]:
        return self.info.split()

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def fenced_blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a markdown file (also inside list items), dedented."""
    blocks, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m or "`" in m["info"]:
            i += 1
            continue
        fence, start, body = m["fence"], i + 1, []
        i += 1
        while i < len(lines) and not re.match(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$", lines[i]):
            body.append(lines[i])
            i += 1
        blocks.append(Block(path, start, m["info"].strip(), textwrap.dedent("\n".join(body)) + "\n"))
        i += 1
    return blocks


def prose(path: Path) -> str:
    """The text of a markdown file without its fenced blocks and inline code spans."""
    out, in_block, fence = [], False, ""
    for line in path.read_text().splitlines():
        m = _FENCE.match(line)
        if not in_block and m and "`" not in m["info"]:
            in_block, fence = True, m["fence"]
            continue
        if in_block:
            if re.match(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$", line):
                in_block = False
            continue
        out.append(re.sub(r"(`+).*?\1", "", line))
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out, in_block, fence = set(), False, ""
    for line in path.read_text().splitlines() if path.suffix == ".md" else []:
        f = _FENCE.match(line)
        if in_block or (f and "`" not in f["info"]):
            if not in_block:
                in_block, fence = True, f["fence"]
            elif re.match(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$", line):
                in_block = False
            continue
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)


def links(path: Path) -> list[str]:
    text = prose(path)
    return _LINK.findall(text) + _REF.findall(text)


# ------------------------------------------------------------------------------------------ README

def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines (at most {MAX_README_LINES}): move detail into docs/"


def test_readme_keeps_the_fresh_machine_commands():
    bash = [b.src.strip() for b in fenced_blocks(README) if b.words[:1] == ["bash"]]
    for cmd in FRESH_MACHINE:
        assert cmd in bash, f"README.md lost its command {cmd!r} (CI and the set-up docs rely on it)"


def test_readme_links_every_docs_page():
    targets = {(README.parent / t.split("#")[0]).resolve() for t in links(README) if "://" not in t}
    for page in PAGES[1:]:
        if page.parent.name == "integrations":
            continue  # linked from the integrations section and through docs/integrations/
        assert page.resolve() in targets, f"README.md does not link {page.relative_to(ROOT)}"


def test_readme_extras_are_the_packages():
    if tomllib is None:
        pytest.skip("tomllib needs Python >= 3.11")
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    named = set(re.findall(r"^\| `([\w-]+)` \|", README.read_text(), re.M))
    assert named == extras, f"README's extras table {sorted(named)} != pyproject.toml's {sorted(extras)}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path):
    bad = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            bad.append(f"{target} (no such file)")
        elif anchor and dest.is_file() and anchor not in anchors(dest):
            bad.append(f"{target} (no heading #{anchor} in {dest.relative_to(ROOT)})")
    assert not bad, f"{page.relative_to(ROOT)}: broken links: {bad}"


# ------------------------------------------------------------------------------------------ blocks

RUN_BLOCKS = [b for page in PAGES for b in fenced_blocks(page) if b.words == ["bash", "run"]]


def _env() -> dict[str, str]:
    env = dict(os.environ, HELION_INTERPRET="1")
    venv_bin = ROOT / ".venv" / "bin"
    bindir = venv_bin if venv_bin.is_dir() else Path(sys.executable).parent
    env["PATH"] = f"{bindir}{os.pathsep}{env.get('PATH', '')}"
    return env


def test_run_blocks_exist_and_are_cheap():
    assert any(b.path == README for b in RUN_BLOCKS), "README.md has no `bash run` block"
    for b in RUN_BLOCKS:
        bad = [w for w in NOT_RUNNABLE if w in b.src]
        assert not bad, f"{b.id}: a `bash run` block must be cheap and CPU-only, it holds {bad}"


@pytest.mark.parametrize("block", RUN_BLOCKS, ids=lambda b: b.id)
def test_bash_run_block(block: Block):
    if not (ROOT / ".venv" / "bin" / "python").exists() and "/.venv/" not in sys.executable:
        pytest.skip("no .venv (bash launch/setup.sh)")
    res = subprocess.run(["bash", "-c", "set -euo pipefail\n" + block.src], cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, f"{block.id} exited {res.returncode}:\n{block.src}\n{(res.stdout + res.stderr)[-4000:]}"
    assert "terminate called" not in res.stderr, res.stderr[-4000:]


PYTHON_BLOCKS = [b for b in fenced_blocks(README) if b.words[:1] == ["python"]]


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=lambda b: b.id)
def test_readme_python_block_compiles(block: Block):
    compile(block.src, block.id, "exec")


def _quick_start() -> list[Block]:
    text = README.read_text().splitlines()
    start = next(i for i, line in enumerate(text, 1) if line.strip() == "## Quick start")
    end = next((i for i, line in enumerate(text, 1) if i > start and line.startswith("## ")), len(text) + 1)
    return [b for b in PYTHON_BLOCKS if start < b.line < end]


def test_quick_start_one_rank(tmp_path):
    """The README's first quick-start program, as written, on the CPU: the loss equals the reference."""
    block = _quick_start()[0]
    assert "fused_linear_cross_entropy(hidden, weight, target)" in block.src, block.src
    script = tmp_path / "quick_start.py"
    script.write_text(block.src)
    res = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                         timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    loss, ref = map(float, res.stdout.split()[-2:])
    assert abs(loss - ref) <= 1e-5 * abs(ref), (loss, ref)


@pytest.mark.dist
def test_quick_start_tensor_parallel(tmp_path):
    """The README's TP program, as written, under torchrun with 2 gloo ranks: a process group with
    vocab_size= and a Shard(0) DTensor weight give the same loss on every rank."""
    block = next(b for b in _quick_start() if "init_process_group" in b.src)
    script = tmp_path / "tp_example.py"
    script.write_text(block.src)
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(script)], cwd=tmp_path, env=dict(_env(), OMP_NUM_THREADS="1"),
                         capture_output=True, text=True, timeout=180)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert "terminate called" not in out, out[-4000:]
    rows = re.findall(r"rank (\d): loss ([\d.]+), DTensor weight ([\d.]+)", res.stdout)
    assert sorted(r for r, _, _ in rows) == ["0", "1"], out[-4000:]
    values = {v for _, a, b in rows for v in (a, b)}
    assert len(values) == 1, rows
