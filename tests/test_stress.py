"""bench/stress_exactness.py: greedy SPD against AR on unusual prompts; a difference must fail the run."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bench_stress", REPO / "bench" / "stress_exactness.py")
stress = importlib.util.module_from_spec(spec)
spec.loader.exec_module(stress)


def test_stress_runs_every_n_and_writes_json(tmp_path, capsys):
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps(["1 2 3 4", [{"role": "user", "content": "Name two colours."}]]))
    rc = stress.main(["--num-stages", "2,3",
                      "--max-new-tokens", "12", "--prompts", str(prompts), "--threads", "1",
                      "--out", str(tmp_path / "s")])
    out = capsys.readouterr().out
    res = json.loads((tmp_path / "s.json").read_text())
    assert rc == 0 and "4 of 4 runs token-identical" in out
    assert res["summary"]["runs"] == 4 and res["summary"]["identical"] == 4
    assert [(r["num_stages"], r["prompt"]) for r in res["rows"]] == [(2, 0), (2, 1), (3, 0), (3, 1)]
    assert all(r["ar_tokens"] == r["spd_tokens"] and 1 <= r["ar_tokens"] <= 12 for r in res["rows"])
    assert res["prompts"][1] == [{"role": "user", "content": "Name two colours."}]


class _Engine:
    """AR gives `ar`; SPD gives `spd`: a stand-in for an engine that went wrong."""

    def __init__(self, ar, spd):
        self.out = {"ar": ar, "spd": spd}

    def generate(self, prompt, max_new_tokens, method="spd"):
        return SimpleNamespace(token_ids=self.out[method], finished_by_eos=False, metrics={"acceptance_rate": 0.5})


@pytest.mark.parametrize("ar,spd,first", [([1, 2, 3, 4], [1, 2, 9, 4], 2), ([1, 2, 3], [1, 2], 2),
                                          ([1, 2], [1, 2, 3], 2), ([1, 2, 3], [1, 2, 3], None)])
def test_stress_finds_the_first_difference(ar, spd, first):
    row, = stress.stress([(3, _Engine(ar, spd))], ["x"], 4)
    assert row["first_difference"] == first and row["identical"] == (first is None)


def test_stress_main_exits_1_and_names_the_mismatch(monkeypatch, capsys):
    import spd_fast

    monkeypatch.setattr(spd_fast, "load", lambda *a, **k: _Engine([5, 6, 7], [5, 8, 7]))
    rc = stress.main(["--num-stages", "2", "--max-new-tokens", "3"])
    captured = capsys.readouterr()
    assert rc == 1 and f"0 of {len(stress.PROMPTS)} runs token-identical" in captured.out
    assert "MISMATCH: n=2 prompt 0: first difference at token 1" in captured.err


@pytest.mark.parametrize("content,message", [("not json", "pass a JSON file holding a list of prompts"),
                                             ("[]", "expected a non-empty JSON list of prompts"),
                                             ('{"a": 1}', "expected a non-empty JSON list of prompts")])
def test_stress_refuses_bad_prompt_files(tmp_path, capsys, content, message):
    f = tmp_path / "p.json"
    f.write_text(content)
    with pytest.raises(SystemExit) as e:
        stress.main(["--prompts", str(f)])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_bench_scripts_give_one_line_errors(capsys, monkeypatch, tmp_path):
    """Bad options of the stress and eval scripts: exit 2 and one line, before anything long runs."""
    import spd_fast

    espec = importlib.util.spec_from_file_location("bench_eval", REPO / "bench" / "eval_acceptance.py")
    ev = importlib.util.module_from_spec(espec)
    espec.loader.exec_module(ev)
    for script, argv, message in [(stress, ["--num-stages", "2,x"], "expected a comma-separated list like 2,3,5"),
                                  (ev, ["--num-stages", "2,x"], "expected a comma-separated list like 2,3,5"),
                                  (ev, ["--limit", "0"], "expected a positive integer, got 0")]:
        with pytest.raises(SystemExit) as e:
            script.main(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err
    loads = []
    monkeypatch.setattr(spd_fast, "load", lambda *a, **k: loads.append(a))
    assert ev.main(["--temperatures", "-1", "--limit", "1", "--no-ar"]) == 2
    assert "eval_acceptance.py: error: temperature must be a finite number >= 0" in capsys.readouterr().err
    assert ev.main(["--limit", "41", "--no-ar"]) == 2
    assert "limit 41 is more than the 40 chat prompts there are" in capsys.readouterr().err
    assert loads == []  # refused before any model loaded

    def small_cache(*a, **k):
        raise spd_fast.SpdConfigError("prompt + max_new_tokens exceeds the KV cache length 64; shorten the prompt, "
                                      "lower max_new_tokens or load with a larger max_len")

    monkeypatch.setattr(spd_fast, "load", small_cache)
    assert ev.main(["--limit", "1", "--no-ar", "--max-len", "64"]) == 2
    assert capsys.readouterr().err.strip().endswith("or load with a larger --max-len")  # the option it has
    with pytest.raises(SystemExit):
        ev.main(["--seed", str(2 ** 64)])
    assert "seed 18446744073709551616 is out of range" in capsys.readouterr().err

    def bad_load(*a, **k):
        raise spd_fast.SpdConfigError("num_stages=40 exceeds the model's 30 layers")

    monkeypatch.setattr(spd_fast, "load", bad_load)
    assert stress.main(["--num-stages", "40"]) == 2
    assert capsys.readouterr().err.strip() == "stress_exactness.py: error: num_stages=40 exceeds the model's 30 layers"
    monkeypatch.setattr(spd_fast, "load", lambda *a, **k: _Engine([1, 2], [1, 2]))
    assert stress.main(["--num-stages", "2", "--max-new-tokens", "2", "--out", str(tmp_path / "r.json")]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["summary"]["identical"] == len(stress.PROMPTS)
    # a head for another model: the advice to load that model names a command that can (this script has no --model)
    import spd_fast.evaluate
    from spd_fast.pdm import DraftMismatchError

    def other_model(*a, **k):
        raise DraftMismatchError("the draft head was trained for a different model (hidden_size: head 64 vs model "
                                 "576); load the model it was trained for (model=<its model>), or train a head")
    monkeypatch.setattr(spd_fast.evaluate, "evaluate_acceptance", other_model)
    assert ev.main(["--limit", "1", "--no-ar", "--out", str(tmp_path / "x")]) == 2
    assert "`spd-fast eval --model <its model> --draft HEAD`" in capsys.readouterr().err


def test_stress_checks_every_n_and_the_out_path_first_and_keeps_finished_runs(monkeypatch, capsys, tmp_path):
    """A bad later n, or an --out that cannot be written, was found only after the earlier runs had finished, and
    their rows (a mismatch among them) were lost; an unwritable --out also exited 1, the code of a mismatch."""
    import spd_fast

    loaded = []

    def load(model, draft, num_stages, **k):
        if num_stages == 40:
            raise spd_fast.SpdConfigError("num_stages=40 exceeds the model's 30 layers")
        loaded.append(num_stages)
        return _Engine([1, 2], [1, 2])

    monkeypatch.setattr(spd_fast, "load", load)
    assert stress.main(["--num-stages", "2,40", "--max-new-tokens", "2"]) == 2
    captured = capsys.readouterr()
    assert "runs token-identical" not in captured.out and "num_stages=40 exceeds" in captured.err
    (tmp_path / "afile").write_text("")
    with pytest.raises(SystemExit) as e:
        stress.main(["--num-stages", "2", "--out", str(tmp_path / "afile" / "res")])
    assert e.value.code == 2 and "--out" in capsys.readouterr().err and loaded == [2]  # no run for either

    class Refuses(_Engine):  # the engine refuses a prompt: the runs before it are reported and written
        def generate(self, prompt, max_new_tokens, method="spd"):
            if prompt == "bad":
                raise spd_fast.SpdConfigError("the prompt is empty")
            return super().generate(prompt, max_new_tokens, method)

    monkeypatch.setattr(spd_fast, "load", lambda *a, **k: Refuses([1, 2], [1, 3]))
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps(["ok", "bad"]))
    rc = stress.main(["--num-stages", "2", "--prompts", str(prompts), "--out", str(tmp_path / "r")])
    captured = capsys.readouterr()
    res = json.loads((tmp_path / "r.json").read_text())
    assert rc == 1 and "MISMATCH: n=2 prompt 0" in captured.err and "error: the prompt is empty" in captured.err
    assert res["summary"] == {**res["summary"], "runs": 1, "identical": 0, "error": "the prompt is empty"}
