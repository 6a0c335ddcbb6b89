"""The `spd-fast` CLI (each subcommand, --json, argument errors), `pytest --benchmark`, bench/report.py.

Short runs on the default model (a few tokens, random draft heads). Most commands run in-process
through `main(argv)`; one subprocess test checks the `python -m spd_fast` entry point.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from spd_fast.__main__ import main
from spd_fast.config import SpdConfigError

REPO = Path(__file__).resolve().parents[1]
METRICS = ("acceptance_rate", "tokens_per_cycle", "equivalent_accept_length", "tokens_per_second", "new_tokens",
           "cycles", "decode_seconds")


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """-> (exit status, stdout, stderr); argparse's SystemExit becomes a status."""
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return rc, out, err


# ---- generate ------------------------------------------------------------------------------------
def test_generate_json_spd_and_ar(capsys):
    base = ["generate", "--user", "Name a colour.", "--max-new-tokens", "4", "--draft", "random", "--json"]
    rc, out, err = run_cli(base, capsys)
    assert rc == 0, err
    spd = json.loads(out)
    assert set(METRICS) <= set(spd["metrics"]) and spd["method"] == "spd" and spd["num_stages"] == 3
    assert spd["draft"] == "random" and 1 <= len(spd["token_ids"]) <= 4 and spd["metrics"]["new_tokens"] == len(
        spd["token_ids"])
    rc, out, err = run_cli(base + ["--method", "ar"], capsys)
    assert rc == 0, err
    ar = json.loads(out)
    assert ar["token_ids"] == spd["token_ids"]  # greedy SPD is token-identical to greedy AR
    assert ar["metrics"]["tokens_per_second"] > 0


def test_generate_streams_then_summary(capsys):
    rc, out, err = run_cli(["generate", "The capital of France is", "-n", "2", "--max-new-tokens", "4",
                            "--draft", "random"], capsys)
    assert rc == 0, err
    import spd_fast  # the streamed text is exactly what generate() returns for the same settings

    eng = spd_fast.load(draft="random", num_stages=2, progress=False)
    assert out == eng.generate("The capital of France is", max_new_tokens=4).text + "\n"
    summary = err.strip().splitlines()[-1]
    for word in ("tokens", "tok/s", "acceptance", "tokens/cycle", "equivalent accept length", "n=2"):
        assert word in summary


def test_generate_summary_names_the_finish_reason(capsys):
    """The summary line says why the answer ended, as --json's finish_reason does: length, eos or stop."""
    base = ["generate", "Count: 1, 2, 3,", "--max-new-tokens", "12", "--threads", "1"]
    rc, out, _ = run_cli(base + ["--json"], capsys)
    full = json.loads(out)
    assert full["finish_reason"] == "length"
    for extra, reason, tokens in [([], "length", 12), (["--eos-id", str(full["token_ids"][4])], "eos", 5),
                                  (["--stop", full["text"][5:8]], "stop", None)]:
        rc, out, err = run_cli(base + extra, capsys)
        summary = err.strip().splitlines()[-1]
        assert rc == 0 and f"tokens (finish_reason={reason})," in summary, (extra, err)
        assert tokens is None or summary.startswith(f"-- {tokens} tokens"), summary
        rc, out, _ = run_cli(base + extra + ["--json"], capsys)
        assert json.loads(out)["finish_reason"] == reason
    rc, _, err = run_cli(base + ["--method", "ar", "--max-new-tokens", "3"], capsys)
    assert rc == 0 and err.strip().splitlines()[-1].startswith("-- 3 tokens (finish_reason=length), "), err
    for method in ("spd", "ar"):  # one token: no decode step to time (it used to say "0.0 tok/s decode")
        rc, _, err = run_cli(base[:3] + ["1", "--threads", "1", "--method", method], capsys)
        assert rc == 0 and err.strip().splitlines()[-1].startswith(
            "-- 1 tokens (finish_reason=length), no decode step (the one token came from the prefill)"), err


def test_cli_doc_shows_generate_output_as_it_is(capsys):
    """docs/CLI.md's --json key list and its example summary line are those of a real run of its first command."""
    doc = (REPO / "docs" / "CLI.md").read_text()
    argv = ["generate", "--user", "Explain photosynthesis in simple terms.", "--threads", "1", "--max-new-tokens", "8"]
    rc, out, _ = run_cli(argv + ["--json"], capsys)
    keys = re.search(r"`--json` prints `\{([^}]*)\}`", doc).group(1)
    assert [k.strip(' "\n') for k in keys.split(",")] == list(json.loads(out))
    rc, _, err = run_cli(argv, capsys)
    shape = lambda line: re.sub(r"\d+(\.\d+)?", "N", line)  # noqa: E731  (the numbers vary)
    example = next(ln for ln in doc.splitlines() if ln.startswith("-- ") and "tok/s decode" in ln)
    assert rc == 0 and shape(example) == shape(err.strip().splitlines()[-1]), (example, err)


# ---- bench / eval --------------------------------------------------------------------------------
def test_bench_json_several_n(capsys, tmp_path):
    rc, out, err = run_cli(["bench", "-n", "2,3", "--prompt", "Hi", "--max-new-tokens", "4", "--draft", "random",
                            "--json", "--out", str(tmp_path / "bench.json")], capsys)
    assert rc == 0, err
    res = json.loads(out)
    assert json.loads((tmp_path / "bench.json").read_text())["rows"] == res["rows"]
    ar = [r for r in res["rows"] if r["method"] == "ar"]
    spd = {r["n"]: r for r in res["rows"] if r["method"] == "spd"}
    assert len(ar) == 1 and sorted(spd) == [2, 3]
    assert (res["meta"]["placement"], res["meta"]["cuda_graphs"]) == ("local", False)  # what ran, not the option
    # what made it: the checkout's commit (this repository is one) and the versions
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert res["meta"]["commit"] == (head or None) and isinstance(res["meta"]["dirty"], (bool, type(None)))
    assert res["meta"]["spd_fast"] and res["meta"]["transformers"]
    for r in spd.values():
        assert r["identical_to_ar"] is True and r["pairs"] == 1 and r["speedup_vs_ar"] > 0
        assert {"acceptance_rate", "tokens_per_cycle", "equivalent_accept_length", "ms_per_cycle"} <= set(r)


def test_bench_speedup_is_the_median_of_back_to_back_pairs(capsys, monkeypatch):
    """Each prompt runs AR then SPD on the same engine, and speedup_vs_ar is the median of those pairs' ratios, not
    the ratio of pooled rates (which lets one slow run, or a drift between an AR pass and a later SPD pass, decide)."""
    from spd_fast.api import Engine

    real = Engine.generate
    spd_seconds = iter([1.0, 2.0, 4.0])
    order = []

    def timed(self, prompt, *a, method="spd", **k):
        out = real(self, prompt, *a, method=method, **k)
        order.append(method)
        if k.get("max_new_tokens") == 8:  # the measured runs (the warm-up asks for 4)
            out.metrics["decode_seconds"] = 1.0 if method == "ar" else next(spd_seconds)
        return out

    monkeypatch.setattr(Engine, "generate", timed)
    rc, out, err = run_cli(["bench", "-n", "2", "--max-new-tokens", "8", "--draft", "random", "--json"], capsys)
    assert rc == 0, err
    rows = json.loads(out)["rows"]
    spd = next(r for r in rows if r["method"] == "spd")
    assert order == ["ar", "spd"] + ["ar", "spd"] * 3  # warm-up, then each prompt's pair back to back
    assert spd["pairs"] == 3 and spd["identical_to_ar"] is True
    assert spd["speedup_vs_ar"] == pytest.approx(0.5)  # ratios 1, 1/2, 1/4 (pooled: 3/7)
    assert rows[0]["method"] == "ar" and rows[0]["tokens_per_s"] == pytest.approx(7 * 3 / 3.0)


@pytest.mark.parametrize("as_json", [False, True])
def test_bench_exits_1_when_spd_differs_from_ar(capsys, monkeypatch, as_json):
    """A greedy SPD run that differs from AR is a bug: exit status 1 and a warning, in table and JSON mode."""
    import spd_fast.cli_bench as cb

    rows = [{"method": "ar", "n": 1, "tokens_per_s": 10.0}, {"method": "spd", "n": 2, "identical_to_ar": False}]
    meta = dict(prompts=1, repeats=1, max_new_tokens=4, temperature=0.0, threads=1, dtype="float32", device="cpu",
                kernels="torch", draft="random")
    monkeypatch.setattr(cb, "run_bench", lambda args, quiet: {"meta": meta, "rows": rows})
    monkeypatch.setattr(cb, "bench_table", lambda rows: "table")
    rc, out, err = run_cli(["bench", "--max-new-tokens", "4"] + (["--json"] * as_json), capsys)
    assert rc == 1 and "greedy SPD output differs from AR; this is a bug" in err
    rows[1]["identical_to_ar"] = True
    assert run_cli(["bench", "--max-new-tokens", "4"] + (["--json"] * as_json), capsys)[0] == 0


def test_bench_table_says_whether_spd_was_identical_to_ar(capsys):
    """The printed table has the identical_to_ar check of the JSON: yes / NO for greedy rows, - when sampling."""
    from spd_fast.cli_bench import bench_table

    rc, out, err = run_cli(["bench", "-n", "2", "--prompt", "Hi", "--max-new-tokens", "4", "--draft", "random",
                            "--threads", "1"], capsys)
    assert rc == 0, err
    header, _, ar, spd = [ln for ln in out.splitlines() if ln.startswith("|")]
    assert header.endswith("| vs AR | identical to AR |") and ar.endswith("| 1.00x | - |") and spd.endswith("| yes |")
    row = {"method": "spd", "n": 2, "tokens_per_s": 1.0, "ms_per_token": 1.0, "acceptance_rate": 0.5,
           "tokens_per_cycle": 0.5, "equivalent_accept_length": 1.0, "ms_per_cycle": 1.0, "speedup_vs_ar": 0.5}
    lines = bench_table([{**row, "identical_to_ar": False}, row]).splitlines()
    assert lines[2].endswith("| NO |") and lines[3].endswith("| - |")  # a sampled run has no check
    assert all(ln.count("|") == lines[0].count("|") for ln in lines)


def test_eval_json_and_files(capsys, tmp_path):
    rc, out, err = run_cli(["eval", "--limit", "1", "--max-new-tokens", "4", "--draft", "random", "--json",
                            "--out", str(tmp_path / "acc")], capsys)
    assert rc == 0, err
    res = json.loads(out)
    cats = [r["category"] for r in res["rows"]]
    assert cats == ["chat", "math", "code", "overall"]
    overall = res["rows"][-1]
    assert overall["prompts"] == 3 and "ar_tokens_per_s" in overall and "speedup_vs_ar" in overall
    assert (tmp_path / "acc.json").is_file() and "| overall |" in (tmp_path / "acc.md").read_text()
    assert res["meta"]["seed"] == 0
    assert 1 <= overall["mean_new_tokens"] <= 4 and 0.0 <= overall["answer_repeat_share"] <= 1.0
    assert overall["accepted"] == sum(r["accepted"] for r in res["rows"][:3])
    assert overall["acceptance_rate"] == pytest.approx(overall["accepted"] / overall["verifications"])
    assert "repeated 4-grams" in (tmp_path / "acc.md").read_text()


def test_eval_rows_pool_the_answers_counts(monkeypatch):
    """evaluate_acceptance sums each answer's counts into its rows (pooled, not averaged): a fake engine whose
    answers repeat known 4-grams and accept known drafts gives rows that can be checked by hand."""
    from types import SimpleNamespace

    import spd_fast
    from spd_fast.evaluate import evaluate_acceptance

    answers = iter([[1, 2, 3, 4, 1, 2, 3, 4, 1], [5, 5, 5, 5, 5, 5], [7, 8, 9]] * 2)  # (2, 6), (2, 3), (0, 0)
    counts = iter([(4, 2), (6, 6), (2, 0)] * 2)

    class Fake:
        draft_source, draft_digest, max_len = "fake", "fake", 2048
        target = SimpleNamespace(cfg=SimpleNamespace(num_layers=30, max_position_embeddings=8192), fingerprint="f",
                                 tokenizer=SimpleNamespace(chat_template="{{ messages }}"), encode=lambda msgs: [1] * 9)

        def _extra_slots(self, method):
            return 0

        def generate(self, msgs, max_new_tokens, temperature, seed, method):
            ids, (ver, acc) = next(answers), next(counts)
            return SimpleNamespace(token_ids=ids, metrics={"verifications": ver, "accepted": acc, "cycles": ver + 1,
                                                          "new_tokens": len(ids), "decode_seconds": 0.1})

    monkeypatch.setattr(spd_fast, "load", lambda **kw: Fake())
    res = evaluate_acceptance((3,), (0.0,), 2, 9, categories=("chat",), with_ar=False, progress=False)
    (chat, overall) = res["rows"]
    assert chat["answer_repeat_share"] == pytest.approx((2 + 2) / (6 + 3))  # two chat prompts: answers 1 and 2
    assert chat["acceptance_rate"] == pytest.approx((2 + 6) / (4 + 6)) and chat["mean_new_tokens"] == 7.5
    assert overall["answer_repeat_share"] == chat["answer_repeat_share"]
    # decoded tokens exclude each answer's prefill token: (9 - 1) + (6 - 1) over (4 + 1) + (6 + 1) cycles, and the
    # equivalent accept length is n times tokens per cycle
    assert chat["tokens_per_cycle"] == pytest.approx(13 / 12)
    assert chat["equivalent_accept_length"] == pytest.approx(3 * 13 / 12)
    assert chat["decoded_tokens"] == 13 and chat["cycles"] == 12


def test_repeat_share_against_brute_force():
    import random

    from spd_fast.evaluate import repeat_share

    assert repeat_share([1, 2, 3, 4, 1, 2, 3, 4, 1]) == (2, 6)   # 1234 2341 3412 4123, then 1234 2341 again
    assert repeat_share([5, 5, 5, 5, 5, 5]) == (2, 3)
    assert repeat_share([1, 2, 3]) == (0, 0)
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(3) for _ in range(rng.randrange(0, 30))]
        k = rng.randrange(1, 5)
        grams = [tuple(ids[i - k + 1:i + 1]) for i in range(k - 1, len(ids))]
        want = sum(g in grams[:j] for j, g in enumerate(grams))
        assert repeat_share(ids, k) == (want, len(grams))


def test_eval_attaches_one_ar_run_to_every_n(monkeypatch):
    """AR runs once per prompt (with the first n); every n's rows carry it, so each SPD/AR ratio is
    measured in the same run, and greedy SPD is checked against it at every n."""
    import spd_fast.api
    from spd_fast.evaluate import evaluate_acceptance

    calls: list[tuple[int, str]] = []
    orig = spd_fast.api.Engine.generate

    def counting(self, *a, **kw):
        calls.append((self.num_stages, kw.get("method")))
        return orig(self, *a, **kw)

    monkeypatch.setattr(spd_fast.api.Engine, "generate", counting)
    res = evaluate_acceptance(num_stages=(2, 3), temperatures=(0.0,), limit=2, max_new_tokens=6, draft="random",
                              categories=("chat",), progress=False)
    assert sorted(calls) == [(2, "ar")] * 2 + [(2, "spd")] * 2 + [(3, "spd")] * 2
    rows = {(r["n"], r["category"]): r for r in res["rows"]}
    assert set(rows) == {(n, c) for n in (2, 3) for c in ("chat", "overall")}
    for n in (2, 3):
        r = rows[n, "overall"]
        assert r["ar_tokens_per_s"] == rows[2, "overall"]["ar_tokens_per_s"]
        assert r["speedup_vs_ar"] == pytest.approx(r["spd_tokens_per_s"] / r["ar_tokens_per_s"])

    def wrong(self, *a, **kw):  # an AR that disagrees with SPD is caught at the second n too
        out = orig(self, *a, **kw)
        if kw.get("method") == "spd" and self.num_stages == 3:
            out.token_ids = out.token_ids[:-1] + [out.token_ids[-1] + 1]
        return out

    monkeypatch.setattr(spd_fast.api.Engine, "generate", wrong)
    with pytest.raises(RuntimeError, match=r"greedy SPD output differs from AR on prompt .*\(n=3\)"):
        evaluate_acceptance(num_stages=(2, 3), temperatures=(0.0,), limit=1, max_new_tokens=6, draft="random",
                            categories=("chat",), progress=False)


def test_eval_seed_changes_sampled_runs_only(capsys):
    def run(*extra):
        rc, out, err = run_cli(["eval", "--limit", "2", "--max-new-tokens", "16", "--json",  # the shipped head
                                "--no-ar", "--categories", "chat", *extra], capsys)
        assert rc == 0, err
        res = json.loads(out)
        return res["meta"]["seed"], [(r["temperature"], r["acceptance_rate"], r["tokens_per_cycle"])
                                     for r in res["rows"]]
    s0, a = run("--temperatures", "0,1.0")
    s0b, b = run("--temperatures", "0,1.0")
    s5, c = run("--temperatures", "0,1.0", "--seed", "5")
    assert (s0, s0b, s5) == (0, 0, 5)
    assert a == b  # the same seed reproduces the sampled run exactly
    assert a[:2] == c[:2]  # greedy rows do not depend on the seed
    assert a[2:] != c[2:]  # the sampled ones do


def test_eval_shows_load_warnings_keeps_dots_in_out_and_records_its_setup(tmp_path, capsys):
    """A random head (no shipped head at n=7) is said, not hidden; `--out x.7` writes x.7.json and x.7.md; meta names
    the model, its weights and the executor, so two results of different models are never paired."""
    out = tmp_path / "n7_t0.7"
    rc, _, err = run_cli(["eval", "-n", "7", "--limit", "1", "--categories", "chat", "--max-new-tokens", "2",
                          "--no-ar", "--max-len", "512", "--threads", "1", "--out", str(out)], capsys)
    assert rc == 0, err
    assert "spd-fast: warning: no shipped draft head" in err and "random" in err, err
    meta = json.loads((tmp_path / "n7_t0.7.json").read_text())["meta"]
    assert (tmp_path / "n7_t0.7.md").is_file() and not (tmp_path / "n7_t0.json").exists()
    assert meta["model"] == "SmolLM2-135M-Instruct" and len(meta["model_fingerprint"]) >= 8
    assert (meta["max_len"], meta["placement"], meta["dtype"], meta["device"]) == (512, "local", "float32", "cpu")
    # the backend that ran, not only the one asked for ("auto"): on a CPU, the C++ ops or the PyTorch twins
    from spd_fast import cpp_ops, kernels
    from spd_fast.evaluate import kernel_backend

    assert meta["kernels"] == meta["kernels_run"] == "torch" and meta["cuda_graphs"] is None  # the default
    assert {"commit", "dirty", "spd_fast", "transformers"} <= set(meta)
    with kernels.use_backend("auto"):
        assert kernel_backend() == "auto" and kernel_backend("cpu") == ("cpp" if cpp_ops.available() else "torch")
    # --json keeps stdout for its JSON, but a random head is still said on stderr (it was hidden)
    rc, out, err = run_cli(["generate", "Hi", "-n", "7", "--max-new-tokens", "2", "--max-len", "512", "--json"], capsys)
    assert rc == 0 and json.loads(out)["draft"] == "random" and "spd-fast: warning: no shipped draft head" in err
    assert meta["kernels"] in ("torch", "cpp", "triton", "auto")


def test_result_paths_and_unwritable_outputs(tmp_path, capsys):
    from spd_fast.cli_common import check_output, result_paths
    from spd_fast.evaluate import write_results

    assert result_paths("a/n3_t0.7") == (Path("a/n3_t0.7.json"), Path("a/n3_t0.7.md"))
    assert result_paths("a/x.json") == result_paths("a/x.md") == (Path("a/x.json"), Path("a/x.md"))
    (tmp_path / "d.json").mkdir()  # <stem>.json is a directory: refused before the run, by bench and eval
    for argv in (["eval", "--limit", "1", "--out", str(tmp_path / "d")], ["bench", "--out", str(tmp_path / "d.json")]):
        rc, _, err = run_cli(argv, capsys)
        assert rc == 2 and "d.json is a directory" in err and len(err.strip().splitlines()) == 1, err
    with pytest.raises(SpdConfigError, match=r"--out .* is a directory"):
        check_output(str(tmp_path / "d.md"), "--out", stem=True)
    (tmp_path / "f").write_text("x")  # a write that fails after the run: one line, not a traceback
    res = {"meta": {"draft": "x"}, "rows": []}
    with pytest.raises(SpdConfigError, match=r"--out: cannot write .*f/r.json .*the results are printed above"):
        write_results(res, tmp_path / "f" / "r")


@pytest.mark.parametrize("argv,message", [
    (["bench", "--max-new-tokens", "1"], "--max-new-tokens: expected an integer >= 2"),
    (["eval", "--max-new-tokens", "1"], "--max-new-tokens: expected an integer >= 2"),
    (["bench", "--threads", "99999999999"], "--threads: expected a thread count from 0 to 4096"),
    (["generate", "hi", "--threads", "-1"], "--threads: expected a thread count from 0 to 4096"),
    (["generate", "hi", "--bogus"], "unrecognized arguments: --bogus (see `spd-fast generate --help`)"),
    (["train", "--bogus"], "(see `spd-fast train --help`)"),
])
def test_bad_arguments_name_the_subcommand(argv, message, capsys):
    rc, _, err = run_cli(argv, capsys)
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_generate_extra_stop_token(capsys):
    rc, out, err = run_cli(["generate", "Count: 1, 2, 3,", "--max-new-tokens", "12", "--json", "--threads", "1"], capsys)
    full = json.loads(out)
    stop = full["token_ids"][4]
    rc, out, err = run_cli(["generate", "Count: 1, 2, 3,", "--max-new-tokens", "12", "--json", "--threads", "1",
                            "--eos-id", str(stop)], capsys)
    d = json.loads(out)
    assert rc == 0 and d["finished_by_eos"] and d["token_ids"] == full["token_ids"][:full["token_ids"].index(stop) + 1]


def test_generate_stop_string(capsys):
    rc, out, _ = run_cli(["generate", "Count: 1, 2, 3,", "--max-new-tokens", "12", "--json", "--threads", "1"], capsys)
    full = json.loads(out)
    stop = full["text"][5:8]
    rc, out, err = run_cli(["generate", "Count: 1, 2, 3,", "--max-new-tokens", "12", "--threads", "1", "--stop", stop],
                           capsys)
    assert rc == 0 and out == full["text"][:full["text"].index(stop)] + "\n", (out, err)
    rc, out, _ = run_cli(["generate", "Count: 1, 2, 3,", "--max-new-tokens", "12", "--json", "--threads", "1",
                          "--stop", stop], capsys)
    assert json.loads(out)["finish_reason"] == "stop"
    rc, _, err = run_cli(["generate", "Count:", "--stop", ""], capsys)
    assert rc == 2 and "stop must be a non-empty string" in err


def test_api_spellings_become_flags():
    from spd_fast.__main__ import build_parser
    from spd_fast.cli_common import cli_message

    p = build_parser()
    for command, api, cli in [
            ("generate", "use 1 <= num_stages <= 30", "use -n from 1 to 30"),
            ("generate", "needs CUDA but this torch build has no GPU; use device='cpu'", "use --device cpu"),
            ("generate", "use placement='sequential' (the default) on CPU", "use --placement local (the default) on CPU"),
            ("generate", "use temperature=0 for greedy decoding", "use --temperature 0 for greedy decoding"),
            ("eval", "use temperature=0 for greedy decoding", "use --temperatures 0 for greedy decoding"),
            ("bench", "slowly; or use backend='cpp')", "slowly; or use --kernels cpp)"),
            ("bench", "use a limit of at most 40", "use --prompts 40 or fewer"),
            ("eval", "use a limit of at most 40", "use --limit 40 or fewer")]:
        assert cli in cli_message(api, p, command), (command, api)
    import argparse  # a script with --num-stages and no -n (bench/eval_acceptance.py)

    script = argparse.ArgumentParser()
    script.add_argument("--num-stages")
    assert "use --num-stages from 1 to 30" in cli_message("use 1 <= num_stages <= 30", script)
    with pytest.raises(SpdConfigError) as e:  # the real messages, as the library raises them
        from spd_fast.evaluate import load_eval_prompts
        load_eval_prompts(("chat",), 41)
    assert "use --limit 40 or fewer" in cli_message(e.value, p, "eval")


# ---- info ----------------------------------------------------------------------------------------
def test_info_lists_a_damaged_cache_marker(tmp_path, capsys, monkeypatch):
    for name, text in (("bad", "{oops"), ("list", "[1]")):
        (tmp_path / "models" / name).mkdir(parents=True)
        (tmp_path / "models" / name / "spd_fast_converted.json").write_text(text)
    monkeypatch.setenv("SPD_FAST_CACHE", str(tmp_path))
    rc, out, err = run_cli(["info", "--json"], capsys)
    assert rc == 0, err
    assert sorted(m["source"] for m in json.loads(out)["cached_models"]) == ["unreadable marker"] * 2


def test_info_text_and_json(capsys):
    rc, out, err = run_cli(["info"], capsys)
    assert rc == 0, err
    for word in ("torch", "transformers", "triton", "device", "cpp_ops", "attention", "shipped heads"):
        assert word in out
    rc, out, _ = run_cli(["info", "--json"], capsys)
    d = json.loads(out)
    assert d["versions"]["torch"] and d["device"] in ("cpu", "cuda")
    assert {"triton", "attention", "cpp_ops"} <= set(d["accelerations"])
    assert "spd_fast[flash]" not in out  # an extra that installed a package nothing used
    assert isinstance(d["cached_models"], list) and isinstance(d["shipped_heads"], list)
    from spd_fast.api import HEADS_DIR  # every shipped head is listed (the checks below would pass on none)
    assert {h["name"] for h in d["shipped_heads"]} == {p.name for p in HEADS_DIR.iterdir() if p.is_dir()}
    for h in d["shipped_heads"]:  # each shipped head is readable and states its sampling calibration
        assert "error" not in h and 0.05 <= h["draft_temperature_scale"] <= 20
        assert len(h["lookup_gate"]) == 2 and all(0 <= v <= 1 for v in h["lookup_gate"])
        assert h["lookup_copy_boost"] is None or 0 <= h["lookup_copy_boost"] <= 30
    rc, out, _ = run_cli(["info"], capsys)
    assert all(f"lookup gate {h['lookup_gate'][0]:g}/{h['lookup_gate'][1]:g}" in out for h in d["shipped_heads"])
    assert all(("copies one-hot when sampling" if h["lookup_copy_boost"] is None
                else f"copies boosted {h['lookup_copy_boost']:g} when sampling") in out for h in d["shipped_heads"])
    shared = [h for h in d["shipped_heads"] if h["weights"] != "draft.safetensors"]
    assert all(f"(weights shared: {h['weights']})" in out for h in shared)


# ---- train ---------------------------------------------------------------------------------------
def test_train_help_is_forwarded(capsys):
    rc, out, _ = run_cli(["train", "--help"], capsys)
    assert rc == 0 and "--draft-layers" in out and "--num-stages" in out


def _tiny_data(path: Path) -> Path:
    import random

    rng = random.Random(0)
    with open(path, "w") as f:
        for i in range(4):
            f.write(json.dumps({"id": f"s{i}", "prompt_ids": [rng.randrange(97) for _ in range(6)],
                                "response_ids": [rng.randrange(97) for _ in range(20)]}) + "\n")
    return path


def test_train_tiny_run(capsys, tmp_path, tiny_checkpoint):
    out_dir = tmp_path / "run"
    rc, _, err = run_cli(["train", "--model", tiny_checkpoint("llama"), "--out", str(out_dir), "--data",
                          str(_tiny_data(tmp_path / "d.jsonl")), "--num-stages", "2", "--steps", "2",
                          "--warmup", "1", "--draft-vocab", "64", "--batch-tokens", "64", "--max-seq-len", "32"],
                         capsys)
    assert rc == 0, err
    assert (out_dir / "train_config.json").is_file() and '"done": true' in err
    from spd_fast.pdm import read_draft_config  # the head has the shape asked for

    dc = read_draft_config(out_dir / "head")
    assert dc.num_stages == 2 and dc.draft_vocab_size == 64


def test_train_missing_data_file(capsys, tmp_path, tiny_checkpoint):
    rc, _, err = run_cli(["train", "--model", tiny_checkpoint("llama"), "--out", str(tmp_path / "o"),
                          "--data", str(tmp_path / "missing.jsonl")], capsys)
    assert rc == 2 and "missing.jsonl does not exist" in err


def test_train_data_jsonl_gz_reads_like_jsonl(tmp_path):
    import gzip

    from spd_fast.train.data import text_file_samples

    plain = _tiny_data(tmp_path / "d.jsonl")
    packed = tmp_path / "d2.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    rows = list(text_file_samples(plain, target=None))
    assert len(rows) == 4 and list(text_file_samples(packed, target=None)) == rows


def test_train_refuses_other_compressed_data(capsys, tmp_path, tiny_checkpoint):
    bad = tmp_path / "d.txt.gz"
    bad.write_bytes(b"\x1f\x8b not text")
    rc, _, err = run_cli(["train", "--model", tiny_checkpoint("llama"), "--out", str(tmp_path / "o"),
                          "--data", str(bad)], capsys)
    assert rc == 2 and "d.txt.gz: only .jsonl.gz is read compressed; decompress it first" in err


def test_committed_self_distillation_data_is_readable():
    """data/self_distill/*.jsonl.gz: rows the trainer takes as they are, none with an eval prompt, and
    the validation file (val_*) shares no prompt with the training files (magpie_*, human_*, gpu_*)."""
    from spd_fast.train.data import PROMPTS_DIR, read_jsonl

    root = Path(__file__).resolve().parents[1] / "data" / "self_distill"
    train_files = sorted([*root.glob("magpie_*.jsonl.gz"), *root.glob("human_*.jsonl.gz"), *root.glob("gpu_*.jsonl.gz")])
    val_files = sorted(root.glob("val_*.jsonl.gz"))
    assert train_files and val_files and len(train_files) + len(val_files) == len(list(root.glob("*.jsonl.gz")))
    held_out = {r["prompt"] for c in ("chat", "math", "code") for r in read_jsonl(PROMPTS_DIR / f"eval_{c}.jsonl")}
    prompts = {}
    for f in train_files + val_files:
        rows = read_jsonl(f)
        assert len(rows) > (500 if f in train_files else 50), f
        for r in rows:
            assert r["prompt_ids"] and 0 < len(r["response_ids"]) <= 256 and r["prompt"] not in held_out
            assert all(0 <= t < 49152 for t in r["prompt_ids"] + r["response_ids"])
        prompts[f] = {r["prompt"] for r in rows}
    trained = set().union(*(prompts[f] for f in train_files))
    for f in val_files:
        assert not prompts[f] & trained, f"{f.name} repeats training prompts"


# ---- argument errors -----------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    pytest.param(["generate"], "give a prompt", id="no-prompt"),
    pytest.param(["generate", "hi", "--user", "x"], "not both", id="prompt-and-user"),
    pytest.param(["generate", "--system", "be brief"], "--system needs at least one --user", id="system-only"),
    pytest.param(["generate", "--user", "hi", "--temperature", "-1"], "temperature must be", id="temperature"),
    pytest.param(["generate", "--user", "hi", "--top-p", "0"], "top_p must be in (0, 1]", id="top-p"),
    pytest.param(["generate", "--user", "hi", "--num-stages", "0"], "expected a positive integer", id="n-zero"),
    pytest.param(["generate", "--user", "hi", "--model", "/nonexistent/model"], "does not exist", id="model"),
    pytest.param(["generate", "--user", "hi", "--method", "tree"], "invalid choice", id="method"),
    pytest.param(["bench", "-n", "2,x"], "comma-separated list like 2,3,5", id="bench-n"),
    pytest.param(["bench", "--kernels", "cuda"], "invalid choice: 'cuda'", id="bench-kernels"),
    pytest.param(["eval", "--categories", "poetry"], "subset of chat,math,code", id="eval-category"),
    pytest.param(["eval", "--limit", "0"], "expected a positive integer", id="eval-limit"),
    *([pytest.param(["eval", "--limit", "1", "--placement", "streams"],  # eval passes its executor on to load
                    "placement='streams' runs the stages on CUDA GPUs", id="eval-streams-on-cpu")]
      if not __import__("torch").cuda.is_available() else []),
    pytest.param(["frobnicate"], "invalid choice", id="unknown-command"),
    pytest.param(["generate", "--user", "hi", "--placement", "gpus"], "invalid choice: 'gpus'", id="placement"),
    *([pytest.param(["generate", "--user", "hi", "--placement", "streams"],
                    "placement='streams' runs the stages on CUDA GPUs", id="streams-on-cpu")]
      if not __import__("torch").cuda.is_available() else []),
    pytest.param(["train"], "the following arguments are required: --out", id="train-no-out"),
    pytest.param(["generate", "--user", "hi", "--threads", "-1"], "--threads: expected a thread count from 0 to 4096, got -1",
                 id="threads-negative"),
    pytest.param(["bench", "--threads", "x"], "--threads: expected a thread count from 0 to 4096, got 'x'", id="bench-threads"),
    pytest.param(["generate", "--user", "hi", "--lookup", "-1"], "--lookup: expected an integer >= 0, got -1",
                 id="lookup-negative"),
    pytest.param(["generate", "--user", "hi", "--lookup", "65"], "lookup must be an integer from 0 to 64", id="lookup-big"),
    pytest.param(["generate", "--user", "hi", "--device", "gpu"], "device 'gpu' is not a valid device", id="device"),
    pytest.param(["generate", "hi", "--temperature", "1", "--seed", str(2**70)], "is out of range", id="seed-range"),
    pytest.param(["eval", "--out", ""], "--out is empty; name a file, or leave --out out", id="eval-out-empty"),
    pytest.param(["generate", "hi", "--max-len", "4"], "--max-len: expected a KV cache length >= 8, got 4",
                 id="max-len-small"),
    pytest.param(["serve", "--max-len", "-1"], "--max-len: expected a KV cache length >= 8, got -1", id="serve-max-len"),
    pytest.param(["generate", "hi", "--model", ""], "--model must be a Hugging Face checkpoint directory or a .gguf "
                 "file (leave it out for the default model); got ''", id="model-empty"),
    pytest.param(["generate", "hi", "--draft", " "], "--draft must be a head directory or 'random' (leave it out for "
                 "the shipped head), got ' '", id="draft-blank"),
    pytest.param(["bench", "--out", " "], "--out is empty; name a file, or leave --out out", id="bench-out-blank"),
])
def test_bad_arguments_exit_nonzero_with_message(capsys, argv, message):
    rc, _, err = run_cli(argv, capsys)
    assert rc == 2 and message in err
    assert len(err.strip().splitlines()) == 1, err  # one line, argparse's malformed arguments included


def test_a_path_the_file_system_refuses_is_one_line_not_a_traceback(capsys, tmp_path):
    """A name over the file system's limit raised OSError (File name too long) from deep inside loading."""
    rc, _, err = run_cli(["generate", "--user", "hi", "--model", str(tmp_path / ("a" * 300))], capsys)
    assert rc == 1 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("spd-fast: error: File name too long (") and err.strip().endswith(
        "; check the path and its permissions"), err


def test_an_empty_system_message_is_sent_not_dropped():
    """--system '' replaces the chat template's default system prompt with an empty one; it used to be dropped,
    and the template's default was used."""
    from argparse import Namespace

    from spd_fast.cli_generate import _prompt

    msgs = _prompt(Namespace(prompt=None, user=["Hi"], system=""))
    assert msgs == [{"role": "system", "content": ""}, {"role": "user", "content": "Hi"}]
    assert _prompt(Namespace(prompt=None, user=["Hi"], system=None)) == [{"role": "user", "content": "Hi"}]
    with pytest.raises(SpdConfigError, match="--system needs at least one --user message"):
        _prompt(Namespace(prompt=None, user=None, system=""))


def test_a_kernel_backend_the_device_cannot_run_fails_before_any_output(capsys, monkeypatch):
    from spd_fast import ops

    monkeypatch.setattr(ops, "BACKEND", ops.BACKEND)  # restored after the test: set_backend is process-wide
    monkeypatch.setattr("spd_fast.triton_kernels._common.interpreting", lambda: False)  # as outside the tests
    rc, out, err = run_cli(["generate", "Hi", "--kernels", "triton", "--max-new-tokens", "2", "--threads", "1"], capsys)
    assert rc == 2 and out == "" and "the Triton kernels need CUDA tensors, got cpu" in err, (out, err)


def test_every_stage_count_is_checked_before_the_first_run(capsys, monkeypatch):
    """bench/eval -n 2,31: the 31 is refused before n=2 generates anything (not after its whole run)."""
    from spd_fast import api
    from spd_fast.evaluate import evaluate_acceptance

    monkeypatch.setattr(api.Engine, "generate", lambda *a, **k: (_ for _ in ()).throw(AssertionError("ran")))
    rc, _, err = run_cli(["bench", "-n", "2,31", "--max-new-tokens", "2", "--threads", "1"], capsys)
    assert rc == 2 and "num_stages=31 exceeds the model's 30 layers" in err, err
    with pytest.raises(SpdConfigError, match="num_stages=31 exceeds the model's 30 layers"):
        evaluate_acceptance((2, 31), (0.0,), 1, 2, progress=False)


def test_errors_name_command_line_flags(capsys):
    """The fix an API error suggests (num_stages=3, draft='random', max_len) is spelt as the CLI's flags."""
    from spd_fast.cli_common import cli_message

    head = os.path.join(REPO, "spd_fast", "heads", "smollm2-135m-instruct-n3")
    rc, _, err = run_cli(["generate", "Hello there", "--draft", head, "-n", "2", "--threads", "1"], capsys)
    assert rc == 2 and "trained for num_stages=3, not 2; pass -n 3, or --draft random, or train a head" in err, err
    rc, _, err = run_cli(["generate", "Hello there", "--max-len", "16", "--max-new-tokens", "64", "--threads", "1"],
                         capsys)
    assert rc == 2 and "lower --max-new-tokens or load with a larger --max-len" in err, err
    from spd_fast.__main__ import build_parser
    from spd_fast.distributed.__main__ import build_parser as distributed_parser

    msg = "omit anchors (a trained head brings its own) or use draft='random'; draft=None for the shipped head"
    assert cli_message(msg, build_parser(), "bench") == \
        "omit anchors (a trained head brings its own) or use --draft random; no --draft for the shipped head"
    assert cli_message("omit anchors", distributed_parser()) == "omit --anchors"
    # only the flags the command has: info has no --max-len, the distributed CLI no --kernels
    assert cli_message("load with a larger max_len", build_parser(), "info") == "load with a larger max_len"
    assert cli_message("load with a larger max_len", build_parser(), "bench") == "load with a larger --max-len"
    assert cli_message("use backend='cpp'", distributed_parser()) == "use backend='cpp'"  # it has no --kernels


@pytest.mark.parametrize("command", ["generate", "bench", "eval", "distributed"])
def test_help_shows_every_default(command, capsys):
    """Every option with a default says it in --help (--max-new-tokens had none)."""
    import argparse

    from spd_fast.__main__ import build_parser
    from spd_fast.distributed.__main__ import build_parser as distributed_parser

    if command == "distributed":
        parser = distributed_parser()
    else:
        sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[command]
    for action in parser._actions:
        if action.option_strings and action.default not in (None, False, [], "", argparse.SUPPRESS):
            fmt = parser._get_formatter()
            fmt.add_argument(action)
            assert "default" in fmt.format_help(), (command, action.option_strings)
    rc, out, _ = run_cli([command, "--help"], capsys)
    want = {"generate": 64, "bench": 32, "eval": 96, "distributed": 64}[command]
    flat = " ".join(out.split())
    assert rc == 0 and re.search(rf"--max-new-tokens MAX_NEW_TOKENS [^-]*\(default: {want}\)", flat), out


def test_cli_doc_names_the_eval_settings_of_the_readme_table():
    doc = " ".join((REPO / "docs" / "CLI.md").read_text().split())
    assert "`spd-fast eval --limit 20 --max-new-tokens 64` reproduces it" in doc


def test_fixes_name_the_command_line_num_stages_and_train_command(capsys, tiny_checkpoint):
    """`use num_stages=3` is `--num-stages 3` in the distributed CLI (-n 3 in spd-fast's); a head of another
    model is to be trained with `spd-fast train` in spd-fast's own messages."""
    from spd_fast.__main__ import build_parser
    from spd_fast.cli_common import cli_message
    from spd_fast.distributed.__main__ import build_parser as distributed_parser

    msg = "start 2 processes (torchrun --nproc-per-node 2) or use num_stages=3"
    assert cli_message(msg, distributed_parser()).endswith("or use --num-stages 3")
    assert cli_message(msg, build_parser(), "generate").endswith("or use -n 3")
    assert cli_message("pass num_stages=3, or draft='random'", distributed_parser()) == \
        "pass --num-stages 3, or --draft random"
    head, other = os.path.join(REPO, "spd_fast", "heads", "smollm2-135m-instruct-n3"), tiny_checkpoint("llama")
    capsys.readouterr()  # the checkpoint's saving progress
    rc, _, err = run_cli(["generate", "Hi", "--model", other, "--draft", head, "--threads", "1"], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert err.strip().endswith("load the model it was trained for (--model <its model>), or train a head for this "
                                "model with `spd-fast train`"), err
    train = "adapt it with `python -m spd_fast.train --init HEAD`, then `python -m spd_fast.train.calibrate`"
    assert cli_message(train, build_parser(), "eval") == \
        "adapt it with `spd-fast train --init HEAD`, then `python -m spd_fast.train.calibrate`"
    assert cli_message(train, distributed_parser()) == train  # not spd-fast: the module is the command there


def test_bfloat16_on_cpu_warns_that_the_packed_fp32_path_is_faster(capsys, tmp_path):
    """--dtype bfloat16 on CPU loses the packed GGUF decode path (fp32 only, about 2.4x faster): one warning line
    that says to drop --dtype, from generate and eval alike; float32 has none."""
    warning = ("spd-fast: warning: --dtype bfloat16 on CPU turns off the packed GGUF decode path (the file's Q4_1/Q8_0 "
               "blocks read by C++ ops, fp32 only), which decodes faster on CPU")
    base = ["generate", "Hi", "--max-new-tokens", "2", "--threads", "1", "--draft", "random"]
    rc, _, err = run_cli(base + ["--dtype", "bfloat16"], capsys)
    lines = [ln for ln in err.splitlines() if "packed GGUF decode path" in ln]
    assert rc == 0 and len(lines) == 1 and lines[0].startswith(warning), err
    assert lines[0].endswith("; drop --dtype (float32 is the default)"), err
    rc, _, err = run_cli(base, capsys)
    assert rc == 0 and "packed GGUF decode path" not in err, err
    rc, _, err = run_cli(["eval", "--limit", "1", "--categories", "chat", "--max-new-tokens", "2", "--no-ar",
                          "--threads", "1", "--dtype", "bfloat16", "--draft", "random"], capsys)
    assert rc == 0 and warning in err, err
    import warnings

    from spd_fast.runtime import load_target

    with pytest.warns(UserWarning, match=r"^dtype='float16' on CPU turns off the packed GGUF decode path .*; use "
                                         r"dtype='float32' \(the default\)$"):  # the Python API's spelling
        load_target(None, "float16", progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_target(None, "bfloat16", progress=False, warn_dtype=False)  # training: it does not decode packed


def test_distributed_takes_the_draft_vocab_spelling_of_train(capsys):
    """--draft-vocab as in spd_fast.train is an option of its own (not only an abbreviation argparse happens to
    allow), listed in --help; --draft-vocab-size still works."""
    from spd_fast.distributed.__main__ import build_parser as distributed_parser

    p = distributed_parser()
    assert p._option_string_actions["--draft-vocab"] is p._option_string_actions["--draft-vocab-size"]
    for flag in ("--draft-vocab", "--draft-vocab-size"):
        assert p.parse_args(["Hi", flag, "512"]).draft_vocab_size == 512
    rc, out, _ = run_cli(["distributed", "--help"], capsys)
    assert rc == 0 and "--draft-vocab SIZE, --draft-vocab-size SIZE" in out


def test_output_paths_are_checked_before_the_run(tmp_path, capsys, monkeypatch):
    """An --out/--output that cannot be written is refused before any model loads, not after the run."""
    from spd_fast.distributed import __main__ as dist_cli
    from spd_fast.train.calibrate import main as calibrate_main

    afile = tmp_path / "afile"
    afile.write_text("x")
    cases = [(["bench", "--out", str(tmp_path)], f"--out {tmp_path} is a directory; name a file in it"),
             (["bench", "--out", f"{afile}/r.json"], f"{afile} is a file, not a directory"),
             (["eval", "--out", f"{tmp_path}/"], "is a directory; name a file stem in it, e.g. "
                                                  f"{tmp_path}/acceptance")]
    for argv, msg in cases:
        rc, _, err = run_cli(argv, capsys)
        assert rc == 2 and msg in err and len(err.strip().splitlines()) == 1, (argv, err)
    assert calibrate_main(["head", "--val", "v.jsonl", "--out", str(tmp_path)]) == 2
    assert f"--out {tmp_path} is a directory" in capsys.readouterr().err
    def fake_load(**kw):  # every rank runs startup_check once all have joined, before anything loads
        kw["startup_check"]()
        raise AssertionError("loaded despite a bad --output")

    monkeypatch.setattr("spd_fast.distributed.engine.load_distributed", fake_load)
    with pytest.raises(SpdConfigError, match=f"--output {afile}/o.json: {afile} is a file"):
        dist_cli.run(dist_cli.build_parser().parse_args(["Hi", "--output", f"{afile}/o.json"]))


def test_entry_point_subprocess():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "spd_fast", "info", "--json"], capture_output=True, text=True,
                       cwd=REPO, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["versions"]["spd_fast"]
    r = subprocess.run([sys.executable, "-m", "spd_fast", "generate", "--user", "hi", "--temperature", "-1"],
                       capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert r.returncode == 2 and "spd-fast: error: temperature must be" in r.stderr


# ---- pytest --benchmark --------------------------------------------------------------------------
def _pytest(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", *args], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **env}, timeout=600)


def test_benchmarks_run_with_flag_and_write_json(tmp_path):
    js = tmp_path / "bench.json"
    # the PyTorch twins only: the C++ backend may need a first-time build, which is not this test's business
    r = _pytest("--benchmark", "-q", "tests/benchmarks/test_bench_ops.py", "-k", "torch", f"--benchmark-json={js}",
                SPD_BENCH_SHORT="1")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "spd_fast benchmarks" in r.stdout
    benches = json.loads(js.read_text())["benchmarks"]
    torch_twins = [b for b in benches if b["extra_info"]["backend"] == "torch"]
    assert len(torch_twins) == len(benches) == 4
    for b in torch_twins:
        assert b["extra_info"]["tokens_per_s"] > 0 and b["extra_info"]["speedup_vs_torch_twin"] == 1.0
        assert b["extra_info"]["short_mode"] is True
        assert b["extra_info"]["threads"] == 1  # _pytest pins OMP_NUM_THREADS=1; the JSON says so


def test_the_test_configuration_honours_pinned_threads_and_leaves_triton_compiled_under_benchmark():
    """conftest set 2 torch threads over an exported OMP_NUM_THREADS=1 (CPU benchmark figures 7-100x apart), and
    TRITON_INTERPRET=1 under --benchmark too, so on a GPU the Triton rows timed the interpreter."""
    code = ("import os, sys; sys.argv = ['pytest'] + sys.argv[1:]; sys.path.insert(0, 'tests'); import conftest, "
            "torch; print(os.environ.get('TRITON_INTERPRET'), torch.get_num_threads())")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "OMP_NUM_THREADS")}

    def probe(*args: str, **extra: str) -> str:
        r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=REPO,
                           env={**env, **extra}, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        return r.stdout.split()

    assert probe(OMP_NUM_THREADS="1") == ["1", "1"]
    assert probe("--benchmark", OMP_NUM_THREADS="1") == ["None", "1"]
    assert probe(OMP_NUM_THREADS="junk")[1] == str(max(1, min(2, os.cpu_count() or 1)))
    assert probe("--benchmark", TRITON_INTERPRET="1", OMP_NUM_THREADS="2") == ["1", "2"]  # the caller's own setting


def test_an_interpreted_triton_benchmark_row_is_skipped_with_the_fix(monkeypatch):
    sys.path.insert(0, str(REPO / "tests" / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location("bench_ops", REPO / "tests" / "benchmarks" / "test_bench_ops.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(REPO / "tests" / "benchmarks"))
    monkeypatch.setattr(mod, "DEVICE", "cuda")  # as on a GPU machine
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(pytest.skip.Exception, match=r"run `TRITON_INTERPRET=0 pytest --benchmark` on the GPU"):
        mod._op("verify_greedy", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert callable(mod._op("verify_greedy", "triton"))


def test_benchmarks_skipped_without_flag():
    r = _pytest("-q", "-rs", "tests/benchmarks/test_bench_ops.py")
    assert r.returncode == 0, r.stdout[-3000:]
    assert "passed" not in r.stdout and "skipped" in r.stdout and "pytest --benchmark" in r.stdout


def test_benchmark_flag_selects_only_benchmarks():
    r = _pytest("--benchmark", "--collect-only", "-q", "tests/test_cli.py", "tests/benchmarks/")
    assert r.returncode == 0, r.stdout[-3000:]
    assert "test_bench_ops.py::test_op" in r.stdout and "test_bench_decode.py::test_decode_spd" in r.stdout
    assert "test_cli.py::" not in r.stdout


def test_benchmark_disable_skips_with_a_reason():
    r = _pytest("--benchmark", "--benchmark-disable", "-q", "-rs", "tests/benchmarks/test_bench_ops.py", "-k", "torch",
                SPD_BENCH_SHORT="1")
    assert r.returncode == 0, r.stdout[-3000:]
    assert "passed" not in r.stdout and "failed" not in r.stdout
    assert "--benchmark-disable: these tests only measure time" in r.stdout


# ---- bench/report.py -----------------------------------------------------------------------------
def _report_module():
    spec = importlib.util.spec_from_file_location("bench_report", REPO / "bench" / "report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _synthetic_results(d: Path) -> None:
    acc = [{"n": n, "temperature": 0.0, "category": c, "prompts": 2, "acceptance_rate": 0.1 * n,
            "tokens_per_cycle": 0.5, "equivalent_accept_length": 0.5 * n, "spd_tokens_per_s": 5.0 + n,
            **({"ar_tokens_per_s": 10.0, "speedup_vs_ar": (5.0 + n) / 10} if n == 2 else {})}
           for n in (2, 3) for c in ("chat", "math", "code", "overall")]
    (d / "acceptance.json").write_text(json.dumps({"meta": {"draft": "random", "limit": 2}, "rows": acc}))
    cyc = [{"n": n, "draft": "random", "ar_step_ms": 50.0, "cycle_ms": 60.0, "stages_ms": 45.0,
            "slowest_stage_ms": 25.0, "pdm_ms": 10.0, "verify_ms": 2.0, "overhead_ms": 3.0, "overhead_vs_ar_step": 0.06,
            "tokens_per_cycle": 0.4, "equivalent_accept_length": 0.4 * n} for n in (2, 3)]
    (d / "cycle.json").write_text(json.dumps({"meta": {}, "rows": cyc}))
    res = {"hf": {"ms_per_token_median": 65.0, "peak_rss_mib": 900},
           "ours": {"ms_per_token_median": 50.0, "peak_rss_mib": 800}}
    (d / "ar_vs_hf.json").write_text(json.dumps({"meta": {"dtype": "float32", "threads": 2}, "speedup": 1.3,
                                                 "results": res}))


def test_report_builds_markdown_and_plots(tmp_path):
    _synthetic_results(tmp_path)
    path = _report_module().write_report(tmp_path, tmp_path / "out")
    text = path.read_text()
    for png in ("plot_acceptance.png", "plot_tokens_per_s.png", "plot_cycle_breakdown.png"):
        assert (tmp_path / "out" / png).stat().st_size > 1000 and png in text
    assert "`bench.json` not found" in text and "1.30x HF" in text and "| overall |" in text


def test_report_speed_table_without_an_ar_baseline(tmp_path):
    _synthetic_results(tmp_path)
    data = json.loads((tmp_path / "acceptance.json").read_text())
    for r in data["rows"]:  # an eval run with --no-ar
        r.pop("ar_tokens_per_s", None), r.pop("speedup_vs_ar", None)
    (tmp_path / "acceptance.json").write_text(json.dumps(data))
    text = _report_module().write_report(tmp_path, tmp_path / "out").read_text()
    assert "| SPD | 2 | 7.0 | no AR in this run |" in text and "nan" not in text


def test_report_takes_benchs_paired_ratio(tmp_path):
    """REPORT.md's vs-AR column for bench.json is bench's own median of back-to-back pairs (it divided the pooled
    rates, 0.43x, where bench printed 0.50x); a bench without pairs shows -."""
    _synthetic_results(tmp_path)
    rows = [{"method": "ar", "n": 1, "tokens_per_s": 7.0, "ms_per_token": 142.9, "decoded_tokens": 21},
            {"method": "spd", "n": 2, "tokens_per_s": 3.0, "ms_per_token": 333.3, "acceptance_rate": 0.5,
             "tokens_per_cycle": 0.5, "equivalent_accept_length": 1.0, "ms_per_cycle": 10.0, "speedup_vs_ar": 0.5,
             "pairs": 3, "decoded_tokens": 21},
            {"method": "spd", "n": 3, "tokens_per_s": 3.5, "ms_per_token": 285.7, "acceptance_rate": 0.5,
             "tokens_per_cycle": 0.5, "equivalent_accept_length": 1.5, "ms_per_cycle": 10.0, "speedup_vs_ar": None,
             "pairs": 0, "decoded_tokens": 0}]
    (tmp_path / "bench.json").write_text(json.dumps({"meta": {}, "rows": rows}))
    text = _report_module().write_report(tmp_path, tmp_path / "out").read_text()
    assert "| SPD | 2 | 3.0 | 0.50x |" in text and "| SPD | 3 | 3.5 | - |" in text, text


def test_report_with_no_results(tmp_path):
    assert _report_module().main(["--results", str(tmp_path)]) == 0
    text = (tmp_path / "REPORT.md").read_text()
    assert "No results found" in text and "`cycle.json` not found" in text
    assert not list(tmp_path.glob("*.png"))


def test_acceptance_table_says_when_the_ar_baseline_did_not_run():
    from spd_fast.evaluate import _row, markdown_table

    c = {"acc": 3, "ver": 4, "decoded": 5, "cycles": 8, "spd_s": 1.0, "ar_tok": 0, "ar_s": 0.0,
         "answers": 2, "new_tok": 7, "rep": 1, "rep_of": 4}
    no_ar = markdown_table([_row(3, 0.0, "math", 2, c)]).splitlines()[-1]
    assert no_ar.endswith("| not run | not run | 4 | 0.250 | - |") and "nan" not in no_ar
    assert "| 0.750 | 0.625 | 1.88 | 5.0 |" in no_ar
    with_ar = markdown_table([_row(3, 0.0, "math", 2, dict(c, ar_tok=10, ar_s=1.0))]).splitlines()[-1]
    assert with_ar.endswith("| 5.0 | 10.0 | 0.50 | 4 | 0.250 | - |")
    old = {k: v for k, v in _row(3, 0.0, "math", 2, c).items() if k not in ("mean_new_tokens", "answer_repeat_share")}
    assert markdown_table([old]).splitlines()[-1].endswith("| not run | not run | - | - | - |")  # rows of older runs
    # with per-prompt counts the row carries them and a bootstrap interval around the pooled rate
    r = _row(3, 0.0, "math", 2, c, [(1, 1), (3, 2)])
    assert r["per_prompt"] == [[1, 1], [3, 2]]
    lo, hi = r["acceptance_ci95"]
    assert 0.5 <= lo <= r["acceptance_rate"] <= hi <= 1.0
    assert markdown_table([r]).splitlines()[-1].endswith(f"| {lo:.3f}-{hi:.3f} |")


# ---- acceptance intervals and bench/compare_acceptance.py ------------------------------------------
def test_acceptance_ci_resamples_prompts():
    from spd_fast.evaluate import acceptance_ci

    same = [(10, 6)] * 30  # every prompt alike: no spread between prompts, a zero-width interval
    assert acceptance_ci(same) == pytest.approx((0.6, 0.6))
    mixed = [(10, 2), (10, 9)] * 15
    lo, hi = acceptance_ci(mixed)
    assert lo < 0.55 < hi and hi - lo > 0.1
    lo4, hi4 = acceptance_ci(mixed * 4)  # four times the prompts: about half the width
    assert 0.35 < (hi4 - lo4) / (hi - lo) < 0.65
    assert acceptance_ci(mixed, seed=1) != (lo, hi) and acceptance_ci(mixed) == (lo, hi)  # seeded
    with pytest.raises(SpdConfigError, match="at least one prompt"):
        acceptance_ci([])


def test_paired_difference_cancels_the_shared_prompt_spread():
    from spd_fast.evaluate import acceptance_ci, paired_difference

    base = [(20, 4), (20, 18)] * 15                   # prompts differ a lot from each other
    new = [(20, v + 1) for _, v in base]              # the new head accepts one more draft on every prompt
    d = paired_difference(base, new)
    assert d["difference"] == pytest.approx(0.05)
    assert 0 < d["ci_low"] <= 0.05 <= d["ci_high"] < 0.1   # paired: the gain is resolved
    lo_b, hi_b = acceptance_ci(base)
    lo_n, hi_n = acceptance_ci(new)
    assert lo_n < hi_b                                # unpaired, the two intervals overlap
    swapped = paired_difference(new, base)
    assert swapped["difference"] == pytest.approx(-0.05) and swapped["ci_high"] < 0
    with pytest.raises(SpdConfigError, match="same prompts in both runs, got 30 and 29"):
        paired_difference(base, new[:-1])


def _compare_module():
    spec = importlib.util.spec_from_file_location("bench_compare", REPO / "bench" / "compare_acceptance.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_compare_acceptance_script(tmp_path, capsys):
    from spd_fast.evaluate import _row

    c = {"acc": 0, "ver": 0, "decoded": 5, "cycles": 8, "spd_s": 1.0, "ar_tok": 0, "ar_s": 0.0,
         "answers": 2, "new_tok": 7, "rep": 1, "rep_of": 4}
    meta = {"limit": 2, "max_new_tokens": 8, "categories": ["math"], "seed": 0, "lookup": 3, "model_fingerprint": "fp",
            "dtype": "torch.float32"}

    def run(name, pp, **m):
        rows = [_row(3, 0.0, "math", len(pp), dict(c, ver=sum(v for v, _ in pp), acc=sum(k for _, k in pp)), pp)]
        f = tmp_path / f"{name}.json"
        f.write_text(json.dumps({"meta": dict(meta, **m), "rows": rows}))
        return str(f)

    a = run("a", [(10, 2), (10, 8)] * 10)
    b = run("b", [(10, 3), (10, 9)] * 10, lookup=0)   # another lookup is a fair comparison
    mod = _compare_module()
    assert mod.main([a, b]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("| 3 | 0.0 | math | 20 | 0.500 | 0.600 | +0.100 | +0.100 to +0.100 |"), line
    # bad input: a clear error, exit status 2
    cases = [(run("c", [(10, 3)] * 20, max_new_tokens=16), "differ in max_new_tokens (8 vs 16)"),
             (run("d", [(10, 3)] * 19), "same prompts in both runs, got 20 and 19"),
             (str(tmp_path / "missing.json"), "does not exist")]
    (tmp_path / "junk.json").write_text("[1, 2]")
    cases.append((str(tmp_path / "junk.json"), "is not an evaluation result"))
    (tmp_path / "calib.json").write_text(json.dumps({"meta": {}, "rows": 3}))  # another tool's result
    cases.append((str(tmp_path / "calib.json"), "is not an evaluation result"))
    (tmp_path / "rowless.json").write_text(json.dumps({"meta": {}, "rows": [{"category": "math"}]}))
    cases.append((str(tmp_path / "rowless.json"), "is not an evaluation result"))
    cases.append((run("m", [(10, 3)] * 20, model_fingerprint="other"), "differ in model_fingerprint"))
    # the fingerprint does not see the dtype: bf16 logits change the target's answers, not the head
    cases.append((run("bf", [(10, 3)] * 20, dtype="torch.bfloat16"), "differ in dtype ('float32' vs 'bfloat16')"))
    # one dtype however spelt (the CLI's "fp32", the API's torch.float32): the runs pair
    assert mod.main([a, run("fp", [(10, 3)] * 20, dtype="fp32")]) == 0
    # a GPU's kernels change the target's answers as bf16 does; "cuda" and "cuda:0" are one kind of device
    cpu = run("cpu", [(10, 3)] * 20, device="cpu")
    cases.append((run("gpu", [(10, 3)] * 20, device="cuda"), "differ in device ('cpu' vs 'cuda')"))
    assert mod.main([run("g0", [(10, 3)] * 20, device="cuda:0"), run("g", [(10, 3)] * 20, device="cuda")]) == 0
    a_cpu = cpu
    (tmp_path / "dir.json").mkdir()
    cases.append((str(tmp_path / "dir.json"), "dir.json is a directory; pass the .json file"))
    (tmp_path / "nullmeta.json").write_text(json.dumps({"meta": None, "rows": json.loads(Path(a).read_text())["rows"]}))
    cases.append((str(tmp_path / "nullmeta.json"), "is not an evaluation result"))
    for bad in ([[15]], [[10, 11]], [[-1, 0]], [["10", "3"]], 7):
        f = run("pp", [(10, 3)] * 20)
        data = json.loads(Path(f).read_text())
        data["rows"][0]["per_prompt"] = bad
        Path(f).write_text(json.dumps(data))
        assert mod.main([a, f]) == 2
        assert "are not [verified, accepted] pairs of counts; the file is damaged" in capsys.readouterr().err, bad
    (tmp_path / "old.json").write_text(json.dumps({"meta": meta, "rows": [{"n": 3, "temperature": 0.0,
                                                                           "category": "math"}]}))
    cases.append((str(tmp_path / "old.json"), "predates them"))
    for path, msg in cases:
        assert mod.main([a_cpu if "device" in msg else a, path]) == 2
        assert msg in capsys.readouterr().err, (path, msg)
    other = run("e", [(10, 3)] * 20)
    data = json.loads(Path(other).read_text())
    data["rows"][0]["n"] = 2
    Path(other).write_text(json.dumps(data))
    assert mod.main([a, other]) == 2 and "share no (n, temperature, category) row" in capsys.readouterr().err


def test_compare_acceptance_prompt_slice(tmp_path, capsys):
    """--prompts START:STOP pairs only those prompts of each category; the overall row is rebuilt from them."""
    from spd_fast.evaluate import _row

    c = {"acc": 0, "ver": 0, "decoded": 5, "cycles": 8, "spd_s": 1.0, "ar_tok": 0, "ar_s": 0.0,
         "answers": 2, "new_tok": 7, "rep": 1, "rep_of": 4}
    meta = {"limit": 4, "max_new_tokens": 8, "categories": ["chat", "math"], "seed": 0, "lookup": 3}

    def run(name, chat, math):
        rows = []
        for cat, pp in (("chat", chat), ("math", math), ("overall", chat + math)):
            rows.append(_row(3, 0.0, cat, len(pp), dict(c, ver=sum(v for v, _ in pp), acc=sum(k for _, k in pp)), pp))
        f = tmp_path / f"{name}.json"
        f.write_text(json.dumps({"meta": meta, "rows": rows}))
        return str(f)

    # B wins big on prompts 0-1 of each category and loses on 2-3
    a = run("a", [(10, 2), (10, 2), (10, 6), (10, 6)], [(10, 5), (10, 5), (10, 8), (10, 8)])
    b = run("b", [(10, 9), (10, 9), (10, 5), (10, 5)], [(10, 9), (10, 9), (10, 7), (10, 7)])
    mod = _compare_module()
    assert mod.main([a, b]) == 0
    whole = capsys.readouterr().out.strip().splitlines()
    assert whole[-1].startswith("| 3 | 0.0 | overall | 8 | 0.525 | 0.750 | +0.225 |"), whole
    assert mod.main([a, b, "--prompts", "2:4"]) == 0
    part = capsys.readouterr().out.strip().splitlines()
    assert part[2].startswith("| 3 | 0.0 | chat | 2 | 0.600 | 0.500 | -0.100 |"), part
    assert part[3].startswith("| 3 | 0.0 | math | 2 | 0.800 | 0.700 | -0.100 |"), part
    assert part[4].startswith("| 3 | 0.0 | overall | 4 | 0.700 | 0.600 | -0.100 |"), part
    for bad, msg in (("2-4", "START:STOP, e.g. 20:40, got '2-4'"), ("3:3", "need 0 <= START < STOP"),
                     ("2:6", "needs 6 prompts per category, the run has 4 for chat; evaluate with --limit 6")):
        assert mod.main([a, b, "--prompts", bad]) == 2
        assert msg in capsys.readouterr().err, bad


def test_eval_and_bench_refuse_before_any_run_what_a_later_n_or_prompt_would_hit(capsys, monkeypatch):
    """A trained head asked for several n, a seed that overflows at a later prompt, --prompts beside --prompt: each
    used to surface after runs had finished (or never: --prompts was ignored). Now one line, before any model
    loads; repeated categories run and are recorded once."""
    import spd_fast

    loads = []
    real_load = spd_fast.load
    monkeypatch.setattr(spd_fast, "load", lambda *a, **k: loads.append(k) or real_load(*a, **k))
    head = "spd_fast/heads/smollm2-135m-instruct-n3"
    for cmd in (["eval", "--limit", "1", "--no-ar"], ["bench"]):
        rc, _, err = run_cli(cmd + ["-n", "3,2", "--draft", head], capsys)
        assert rc == 2 and "the draft head was trained for num_stages=3, not 2" in err, err
        assert len(err.strip().splitlines()) == 1
    rc, _, err = run_cli(["eval", "--limit", "2", "--seed", str(2 ** 64 - 1)], capsys)
    assert rc == 2 and f"seed {2 ** 64 - 1} is too large for 2 prompts per category" in err, err
    assert f"use a seed <= {2 ** 64 - 2}" in err
    rc, _, err = run_cli(["eval", "--seed", str(2 ** 64)], capsys)
    assert rc == 2 and "argument --seed: seed 18446744073709551616 is out of range" in err, err
    rc, _, err = run_cli(["bench", "--prompt", "Hi", "--prompts", "2"], capsys)
    assert rc == 2 and "--prompts counts held-out prompts per category, which --prompt replaces" in err, err
    assert loads == []
    rc, out, err = run_cli(["eval", "--limit", "1", "--max-new-tokens", "3", "--draft", "random", "--no-ar",
                            "--categories", "chat,chat", "--json"], capsys)
    res = json.loads(out)
    assert rc == 0 and res["meta"]["categories"] == ["chat"], err
    assert [r["category"] for r in res["rows"]] == ["chat", "overall"]


def test_eval_and_bench_check_every_prompt_fits_before_any_run(capsys, monkeypatch, tiny_checkpoint, tmp_path):
    """A held-out prompt too long for --max-len stopped eval after every earlier prompt had run, naming neither it
    nor the --max-len it needs; bench's warm-up asked 4 new tokens when the runs asked fewer, so a run that fit was
    refused; both name a model without a chat template as such; dtypes are recorded under one spelling."""
    import spd_fast.api

    runs = []
    orig = spd_fast.api.Engine.generate
    monkeypatch.setattr(spd_fast.api.Engine, "generate", lambda self, *a, **k: runs.append(k) or orig(self, *a, **k))
    rc, _, err = run_cli(["eval", "--limit", "40", "--categories", "chat,code", "--max-new-tokens", "64",
                          "--max-len", "160", "--no-ar", "--draft", "random"], capsys)
    assert rc == 2 and runs == [], err
    assert re.search(r"prompt code \S+ \((\d+) tokens\) \+ --max-new-tokens 64 \+ 4 in-flight slots \(n=3\) = "
                     r"(\d+) exceeds the KV cache length 160; pass --max-len \2 \(or more\)", err), err
    rc, out, err = run_cli(["bench", "--prompt", "hi", "--max-new-tokens", "2", "-n", "2", "--draft", "random",
                            "--max-len", "36", "--json"], capsys)  # 31 prompt tokens + 2 + 3 in-flight slots
    assert rc == 0 and json.loads(out)["meta"]["dtype"] == "float32", err
    assert max(k["max_new_tokens"] for k in runs) == 2
    rc, out, err = run_cli(["eval", "--limit", "1", "--categories", "chat", "--max-new-tokens", "2", "--no-ar",
                            "--draft", "random", "--dtype", "fp32", "--json"], capsys)
    assert rc == 0 and json.loads(out)["meta"]["dtype"] == "float32", err
    import shutil

    base = tmp_path / "base"  # a model whose tokenizer has no chat template
    shutil.copytree(tiny_checkpoint("llama"), base)
    (base / "chat_template.jinja").unlink(missing_ok=True)
    tc = json.loads((base / "tokenizer_config.json").read_text())
    (base / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in tc.items() if k != "chat_template"}))
    runs.clear()
    for cmd in (["eval", "--limit", "1", "--no-ar"], ["bench", "--prompt", "hi"]):
        rc, _, err = run_cli(cmd + ["--max-new-tokens", "2", "--draft", "random", "--model", str(base)], capsys)
        assert rc == 2 and f"{cmd[0]} asks its prompts through the model's chat template, and this model's tokenizer " \
                           f"has none (a base model); use a chat (instruct) model" in err, err
    assert runs == []


def test_generate_prints_what_the_terminal_cannot_encode_as_replacements(capsys, monkeypatch):
    """A Latin-1 or cp1252 stdout stopped the answer mid-stream with a UnicodeEncodeError traceback."""
    import io

    import spd_fast.api

    monkeypatch.setattr(spd_fast.api.Engine, "stream", lambda self, *a, **k: iter(["caf\u00e9 ", "\u65e5\u672c!"]))
    monkeypatch.setattr(spd_fast.api.Engine, "last_metrics", {}, raising=False)
    monkeypatch.setattr(spd_fast.api.Engine, "last_finish_reason", "length", raising=False)
    monkeypatch.setattr("spd_fast.cli_generate.summary_line", lambda *a: "summary")
    raw = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(raw, encoding="latin-1"))
    rc = main(["generate", "hi", "--max-new-tokens", "2", "--draft", "random"])
    sys.stdout.flush()
    assert rc == 0 and raw.getvalue().decode("latin-1") == "caf\u00e9 ??!\n"


def test_report_skips_results_of_another_shape_with_a_note(tmp_path):
    """A file that parses but is not the expected bench's output (a bench result saved as acceptance.json, a JSON
    list) crashed the report with a KeyError / AttributeError."""
    _synthetic_results(tmp_path)
    (tmp_path / "acceptance.json").write_text(json.dumps({"rows": [{"method": "ar", "tokens_per_s": 9.0}]}))
    (tmp_path / "cycle.json").write_text("[1, 2]")
    (tmp_path / "bench.json").write_text(json.dumps({"rows": [{"method": "spd", "tokens_per_s": 9.0}]}))
    text = _report_module().write_report(tmp_path, tmp_path / "out").read_text()
    assert "`acceptance.json` is not what" in text and "row 0 lacks n, temperature, category" in text
    assert "`cycle.json` is not what" in text and "a JSON list, not an object" in text
    assert "`bench.json` is not what" in text and "row 0 lacks n" in text
    assert "1.30x HF" in text  # the good file is still reported


def test_bench_and_eval_lists_take_each_value_once():
    """`-n 2,2` or `--temperatures 0,0` would run and print the same rows twice; stage boundaries keep a repeat
    (their own check names it)."""
    from spd_fast.cli_common import float_list, int_list, layer_list

    assert int_list("3,2,3,2") == [3, 2] and float_list("0,0.7,0.0") == [0.0, 0.7]
    assert layer_list("0,10,10,30") == [0, 10, 10, 30]


def test_generate_reads_the_prompt_from_standard_input(monkeypatch):
    """`echo ... | spd-fast generate -` took "-" as the prompt text."""
    import argparse
    import io

    from spd_fast.cli_generate import _prompt

    def args(prompt):
        return argparse.Namespace(prompt=prompt, user=[], system=None)

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("Héllo, world\n".encode())))
    assert _prompt(args("-")) == "Héllo, world"  # the newline echo adds is dropped
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9")))
    with pytest.raises(SpdConfigError, match=r"standard input is not UTF-8 text \(byte 3: b'\\xe9'\); convert it"):
        _prompt(args("-"))
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\n")))
    with pytest.raises(SpdConfigError, match="standard input was empty"):
        _prompt(args("-"))
    assert _prompt(args("plain")) == "plain"


def test_a_closed_stdout_and_a_greedy_mismatch_are_one_line(capsys, monkeypatch):
    """`spd-fast generate hi >&-` died in an AttributeError traceback; an eval whose greedy SPD differed from AR
    raised a raw RuntimeError where bench says it in one line with status 1."""
    r = subprocess.run(["bash", "-c", f"{sys.executable} -m spd_fast generate hi >&-"], capture_output=True,
                       text=True, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120)
    assert r.returncode == 2 and r.stderr.strip() == ("spd-fast: error: standard output is closed; run it with an "
                                                      "output (a terminal, a pipe or > FILE)"), r.stderr
    import spd_fast.evaluate as ev

    def mismatch(*a, **k):
        raise ev.GreedyMismatch("greedy SPD output differs from AR on prompt chat-0 (n=3); this is a bug")

    monkeypatch.setattr(ev, "evaluate_acceptance", mismatch)
    rc, out, err = run_cli(["eval", "--limit", "1", "--max-new-tokens", "2"], capsys)
    assert rc == 1 and err.strip() == "spd-fast: error: greedy SPD output differs from AR on prompt chat-0 (n=3); " \
                                      "this is a bug" and out == ""


def test_importing_the_package_does_not_import_torch():
    """The public names load on first use: `import spd_fast` is instant, and a Ctrl-C during the CLI's start lands in
    its handler (exit 130) rather than in a traceback through torch's import."""
    code = ("import sys, spd_fast; assert 'torch' not in sys.modules, 'torch imported'; "
            "from spd_fast import generate, SamplingParams, SpdConfigError; import spd_fast.engine; "
            "assert spd_fast.engine.SPDEngine and spd_fast.Engine.__name__ == 'Engine'; "
            "assert not hasattr(spd_fast, 'no_such_thing') and 'generate' in dir(spd_fast'); print('ok')")
    code = code.replace("dir(spd_fast')", "dir(spd_fast)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
