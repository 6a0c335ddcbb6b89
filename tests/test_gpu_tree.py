"""bench/gpu_tree.sh: the shipped heads leave a device call's tree on a throwaway branch and come back
unchanged; a dirty tree and a restore without a slim are refused with a message that names the fix."""
from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_tree.sh"


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout


@pytest.fixture
def repo(tmp_path):
    """A small git repository shaped like ours: a tracked head directory and the script."""
    r = tmp_path / "r"
    (r / "spd_fast" / "heads" / "h").mkdir(parents=True)
    (r / "bench").mkdir()
    (r / "spd_fast" / "heads" / "h" / "draft.safetensors").write_bytes(bytes(range(256)) * 64)
    (r / "spd_fast" / "heads" / "h" / "draft_config.json").write_text("{}")
    (r / "spd_fast" / "api.py").write_text("x = 1\n")
    shutil.copy(SCRIPT, r / "bench" / "gpu_tree.sh")
    _git(r, "init", "-q", "-b", "main")
    _git(r, "add", "-A")
    _git(r, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "init")
    return r


def _run(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "bench/gpu_tree.sh", *args], cwd=repo, capture_output=True, text=True)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_slim_takes_the_heads_out_of_the_tree_and_restore_brings_back_main(repo):
    w = repo / "spd_fast" / "heads" / "h" / "draft.safetensors"
    before, head_before = _digest(w), _git(repo, "rev-parse", "HEAD")
    r = _run(repo, "slim")
    assert r.returncode == 0, r.stderr
    assert _git(repo, "rev-parse", "--abbrev-ref", "HEAD").strip() == "gpu-slim"
    tracked = _git(repo, "ls-files").split()
    assert "spd_fast/api.py" in tracked and not any(t.startswith("spd_fast/heads/") for t in tracked)
    assert _git(repo, "status", "--porcelain") == ""  # on disk, but ignored: not in the device call's tree
    assert _digest(w) == before
    r = _run(repo, "restore")
    assert r.returncode == 0, r.stderr
    assert _git(repo, "rev-parse", "--abbrev-ref", "HEAD").strip() == "main"
    assert _git(repo, "rev-parse", "HEAD") == head_before
    assert "gpu-slim" not in _git(repo, "branch")
    assert _git(repo, "status", "--porcelain") == "" and _digest(w) == before
    assert "/spd_fast/heads/" not in (repo / ".git" / "info" / "exclude").read_text()


def test_refusals_name_the_fix(repo):
    r = _run(repo, "restore")
    assert r.returncode == 2 and "nothing to restore (run 'slim' first)" in r.stderr
    (repo / "spd_fast" / "api.py").write_text("x = 2\n")
    r = _run(repo, "slim")
    assert r.returncode == 2 and "commit or stash your changes first" in r.stderr
    assert _git(repo, "rev-parse", "--abbrev-ref", "HEAD").strip() == "main"
    r = _run(repo)
    assert r.returncode == 2 and "usage: bash bench/gpu_tree.sh slim|restore" in r.stderr
