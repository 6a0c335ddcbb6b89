"""The figures the README quotes agree with the result files they come from, and every result file the docs cite
exists. A rerun of a benchmark that changes a figure then fails here until the prose is updated with it."""
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _acceptance_rows():
    return json.loads((ROOT / "bench/results/acceptance.json").read_text())["rows"]


def test_readme_acceptance_table_equals_its_result_file():
    text = (ROOT / "README.md").read_text()
    table = [line for line in text.splitlines()
             if re.match(r"\| [2-6] \| [01]\.\d \| (chat|math|code|overall) \|", line)]
    assert table, "README has no acceptance table"
    by_key = {(r["n"], r["temperature"], r["category"]): r for r in _acceptance_rows()}
    for line in table:
        cells = [c.strip() for c in line.strip("|").split("|")]
        row = by_key[(int(cells[0]), float(cells[1]), cells[2])]
        assert cells[3] == f"{row['acceptance_rate']:.3f}", line
        assert cells[4] == f"{row['tokens_per_cycle']:.3f}", line
        assert cells[5] == f"{row['equivalent_accept_length']:.2f}", line


def test_quoted_sampled_n3_figures_equal_the_result_file():
    """Prose elsewhere quotes the n=3 head's sampled acceptance as "n=3: a / b" (T=0.7 / 1.0); a stale pair from an
    earlier run once stood there beside the table's own figures."""
    overall = {r["temperature"]: r["acceptance_rate"] for r in _acceptance_rows()
               if r["n"] == 3 and r["category"] == "overall"}
    want = f"{overall[0.7]:.3f} / {overall[1.0]:.3f}"
    found = []
    for path in DOCS:
        for m in re.finditer(r"\(n=3: (0\.\d{3} / 0\.\d{3})|(0\.\d{3} / 0\.\d{3}) for the n=3 head", path.read_text()):
            found.append((path.name, m.group(1) or m.group(2)))
    assert found, "no quoted n=3 sampled pair found; update this test with the prose"
    assert all(pair == want for _, pair in found), (want, found)


def test_cited_result_files_exist():
    """Result files named in the prose exist. Commands' outputs (`--out X`, `--benchmark-json=X`, `# -> X`) and
    placeholders (HEAD, <date>) are not citations."""
    missing = []
    for path in DOCS:
        text = path.read_text()
        for m in re.finditer(r"bench/results/[A-Za-z0-9_./-]+\.(?:json|md|png|txt)\b", text):
            before = text[max(0, m.start() - 12):m.start()]
            if re.search(r"(--out |=|-> )$", before) or "HEAD" in m.group(0):
                continue
            if not (ROOT / m.group(0)).exists():
                missing.append(f"{path.name}: {m.group(0)}")
    assert not missing, missing


def test_every_public_name_has_its_own_docstring():
    """Every name spd_fast and spd_fast.distributed export, and each public method of the classes among them, has
    a docstring of its own (a dataclass's generated `Name(field, ...)` signature is none)."""
    import inspect

    import spd_fast
    import spd_fast.distributed as dist

    missing = []
    for mod in (spd_fast, dist):
        for name in mod.__all__:
            obj = getattr(mod, name)
            doc = obj.__doc__ or ""
            if not doc.strip() or doc.startswith(f"{name}("):
                missing.append(f"{mod.__name__}.{name}")
            if inspect.isclass(obj) and not issubclass(obj, BaseException):
                for attr, member in vars(obj).items():
                    fn = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
                    if not attr.startswith("_") and callable(fn) and not (fn.__doc__ or "").strip():
                        missing.append(f"{mod.__name__}.{name}.{attr}")
    assert not missing, missing
