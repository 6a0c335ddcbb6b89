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
    assert r.returncode == 2 and "usage: bash bench/gpu_tree.sh slim [min] | restore" in r.stderr
    _git(repo, "checkout", "-q", "--", ".")
    _git(repo, "checkout", "-q", "--detach")
    r = _run(repo, "slim")
    assert r.returncode == 2 and "HEAD is detached; check out a branch first" in r.stderr


def test_slim_min_also_drops_the_data_and_restore_keeps_commits_made_on_the_slim_branch(repo):
    """`slim min` (the first call of the training recipe) also takes data/self_distill out; a commit made on
    gpu-slim by mistake is not deleted by restore, which says how to keep it."""
    (repo / "data" / "self_distill").mkdir(parents=True)
    (repo / "data" / "self_distill" / "a.jsonl.gz").write_bytes(b"x" * 1000)
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "data")
    r = _run(repo, "slim", "min")
    assert r.returncode == 0, r.stderr
    tracked = _git(repo, "ls-files").split()
    assert not any(t.startswith(("spd_fast/heads/", "data/")) for t in tracked) and _git(repo, "status", "--porcelain") == ""
    assert "bytes travel" in r.stdout
    r = _run(repo, "slim")
    assert r.returncode == 2 and "already slim" in r.stderr
    (repo / "spd_fast" / "api.py").write_text("x = 3\n")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-am", "oops, on gpu-slim")
    r = _run(repo, "restore")
    assert r.returncode == 2 and "has commits made after the slim, which restore would delete" in r.stderr
    assert _git(repo, "rev-parse", "--abbrev-ref", "HEAD").strip() == "gpu-slim"
    _git(repo, "reset", "-q", "--hard", "HEAD~1")
    r = _run(repo, "restore")
    assert r.returncode == 0, r.stderr
    tracked = _git(repo, "ls-files").split()
    assert "data/self_distill/a.jsonl.gz" in tracked and "spd_fast/heads/h/draft.safetensors" in tracked
    excl = (repo / ".git" / "info" / "exclude").read_text()
    assert "/data/self_distill/" not in excl and "/spd_fast/heads/" not in excl
