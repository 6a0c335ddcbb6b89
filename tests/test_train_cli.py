"""`python -m spd_fast.train` / `spd_fast.train.calibrate` / `spd-fast eval` on their inputs: data formats (chat rows,
.json lists, any-case suffixes), bad files and options, resuming into an existing --out, self-distillation
answers of another run, and --epochs under torchrun. Each bad input is one clear error with exit status 2."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

from spd_fast.train.__main__ import main as train_main


@pytest.fixture(scope="module")
def full_vocab_checkpoint(tmp_path_factory):
    """A tiny random Llama with the default tokenizer's whole 49,152-token vocabulary, so real text (chat
    templates, self-distillation prompts) tokenizes into it."""
    from conftest import _tiny_config, save_random_checkpoint

    cfg = _tiny_config("llama")
    cfg.vocab_size = 49152
    return save_random_checkpoint(cfg, tmp_path_factory.mktemp("full"), zlib.crc32(b"full") % 1000)


def run(argv, capsys) -> tuple[int, str]:
    try:
        rc = train_main(argv)
    except SystemExit as e:  # argparse
        rc = e.code
    return rc, capsys.readouterr().err


def small(model: str, out: Path, *extra: str) -> list[str]:
    return ["--model", model, "--out", str(out), "--num-stages", "3", "--draft-vocab", "64", "--batch-tokens", "128",
            "--max-seq-len", "64", "--warmup", "1", "--threads", "1", "--no-feature-cache", *extra]


CHAT = [{"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
                      {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "Green, too."}]},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello!"}]}]


def test_chat_rows_give_one_sample_per_assistant_turn(default_target, tmp_path):
    from spd_fast.train.data import text_file_samples

    f = tmp_path / "chat.JSONL"  # suffixes in any case
    f.write_text("".join(json.dumps(r) + "\n" for r in CHAT))
    rows = list(text_file_samples(f, default_target))
    tok = default_target.tokenizer
    assert [r["id"] for r in rows] == ["chat-0-0", "chat-0-1", "chat-1"]
    assert [tok.decode(r["response_ids"]).strip().split("<|im_end|>")[0] for r in rows] == ["Blue.", "Green, too.",
                                                                                            "Hello!"]
    assert rows[1]["prompt_ids"] == default_target.encode(CHAT[0]["messages"][:3])  # the conversation before it
    # each answer ends at its end-of-turn token: what the template adds after it is never decoded, so takes no loss
    assert all(r["response_ids"][-1] in default_target.eos_ids for r in rows)
    # an opening assistant turn has no conversation before it to be its prompt (the template refuses an empty one):
    # it comes as an empty answer marked as such, which the train command counts in its log
    opening = {"messages": [{"role": "assistant", "content": "How can I help?"}] + CHAT[0]["messages"][:2]}
    (tmp_path / "opening.jsonl").write_text(json.dumps(opening) + "\n")
    first = list(text_file_samples(tmp_path / "opening.jsonl", default_target))
    assert [r["response_ids"] for r in first[:1]] == [[]] and first[0]["skipped"] == "opening assistant turn"
    assert [tok.decode(r["response_ids"]).split("<|im_end|>")[0] for r in first[1:]] == ["Blue."]
    # in a .txt file a line of spaces ends a block as an empty line does
    t = tmp_path / "blocks.txt"
    t.write_text("First block.\nline two.\n  \t\nSecond block.\n\nThird block.\n")
    assert [tok.decode(r["response_ids"]).strip() for r in text_file_samples(t, default_target)] == [
        "First block.\nline two.", "Second block.", "Third block."]
    js = tmp_path / "chat.json"  # a .json file: one list of the same rows
    js.write_text(json.dumps(CHAT))
    assert [r["response_ids"] for r in text_file_samples(js, default_target)] == [r["response_ids"] for r in rows]


def test_training_on_chat_data_runs(full_vocab_checkpoint, tmp_path, capsys):
    f = tmp_path / "chat.jsonl"
    opening = {"messages": [{"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "Hello"},
                            {"role": "assistant", "content": "How are you?"}]}
    f.write_text("".join(json.dumps(r) + "\n" for r in CHAT * 3 + [opening]))
    rc, err = run(small(full_vocab_checkpoint, tmp_path / "o", "--data", str(f), "--val", str(f), "--steps", "2",
                        "--save-every", "2", "--draft-vocab", "49152"), capsys)
    assert rc == 0, err
    assert '{"skipped_opening_assistant_turns": 1}' in err  # counted, not silently dropped
    assert '"done": true' in err and (tmp_path / "o" / "best_head" / "val.json").is_file()
    from spd_fast.pdm import read_draft_config

    dc = read_draft_config(tmp_path / "o" / "head")  # small(): n=3
    assert dc.num_stages == 3 and dc.draft_vocab_size == 49152  # every row scored
    # a 64-token draft vocabulary holds none of these answers' tokens: the validation scores no row, says so, and
    # keeps no best head on that non-evidence
    rc, err = run(small(full_vocab_checkpoint, tmp_path / "o64", "--data", str(f), "--val", str(f), "--steps", "2",
                        "--save-every", "2"), capsys)
    assert rc == 0 and "validation scored no row" in err and "raise --draft-vocab" in err, err
    assert not (tmp_path / "o64" / "best_head").exists()


@pytest.mark.parametrize("name,content,message", [
    ("bad.jsonl", '{"text": "a"}\n{"text": \n', r"bad.jsonl, line 2: not valid JSON .* must be one JSON object"),
    ("list.jsonl", '[1, 2]\n', r"list.jsonl, line 1: a JSON list, not an object"),
    ("textnum.jsonl", '{"text": 5}\n', r"textnum.jsonl, row 1: \"text\" must be a string, got 5"),
    ("keys.jsonl", '{"text": "a"}\n{"body": "b"}\n', r"keys.jsonl, row 2: a row needs \"messages\" \(chat\), \"text\", "
                                                     r"or \"prompt_ids\" \+ \"response_ids\" \(token ids\); got keys "
                                                     r"\['body'\]"),
    ("user.jsonl", json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n",
     r"user.jsonl, row 1: the chat has no assistant message, so there is nothing to train on"),
    ("case.jsonl", json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "Assistant", "content": "x"},
                                            {"role": "user", "content": "and?"},
                                            {"role": "assistant", "content": "y"}]}),
     r"case.jsonl, row 1: message 2 has role 'Assistant'; use one of 'system', .*'assistant'"),
    ("surrogate.jsonl", '{"text": "ok"}\n{"text": "a\\ud800b"}\n',
     r"surrogate.jsonl, row 2: the text is not valid Unicode text: '\\ud800' at character 1 is a lone surrogate"),
    ("chatsur.jsonl", json.dumps({"messages": [{"role": "user", "content": "a\ud83d"}, {"role": "assistant",
                                                                                     "content": "x"}]}),
     r"chatsur.jsonl, row 1: the content of message 1 is not valid Unicode text"),
    ("deep.jsonl", "[" * 100000 + "\n", r"deep.jsonl, line 1: not valid JSON .*maximum recursion depth"),
    ("deep.json", "[" * 100000, r"deep.json: not valid JSON .*maximum recursion depth"),
    ("rows.json", '{"text": "a"}', r"rows.json: a .json data file must hold a list of JSON objects"),
    ("d.csv", "a,b\n", r"d.csv: unknown format '.csv'; use .jsonl, .jsonl.gz, .json"),
    ("float.jsonl", '{"prompt_ids": [1, 2], "response_ids": [3.7, 4]}\n',
     r"float.jsonl, row 1: \"response_ids\" must be a list of integer token ids"),
    ("bool.jsonl", '{"prompt_ids": [true], "response_ids": [3]}\n',
     r"bool.jsonl, row 1: \"prompt_ids\" must be a list of integer token ids"),
    ("big.jsonl", '{"prompt_ids": [1], "response_ids": [3, 49152]}\n',
     r"big.jsonl, row 1: \"response_ids\" holds 49152, not a token id of this model \(0..49151\)"),
    ("str.jsonl", '{"prompt_ids": ["1"], "response_ids": [3]}\n', r"must be a list of integer token ids"),
    ("role.jsonl", json.dumps({"messages": [{"role": 5, "content": "hi"}, {"role": "assistant", "content": "x"}]}),
     r"role.jsonl, row 1: \"messages\" must be a non-empty list of .* with string values"),
    ("empty.jsonl", '{"text": ""}\n{"prompt_ids": [1], "response_ids": []}\n',
     r"every one of the 2 training samples has an empty answer \(no tokens to train on\)"),
    ("d.parquet", "x", r"d.parquet: reading .parquet needs pandas and pyarrow \(pip install pandas pyarrow\)"),
])
def test_bad_data_files_are_named(full_vocab_checkpoint, tmp_path, capsys, monkeypatch, name, content, message):
    if name.endswith(".parquet"):  # pandas is not a dependency: the message is what a user without it sees
        monkeypatch.setitem(sys.modules, "pandas", None)  # "import pandas" fails here, installed or not
    f = tmp_path / name
    f.write_text(content)
    rc, err = run(small(full_vocab_checkpoint, tmp_path / "o", "--data", str(f), "--steps", "1"), capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert re.search(message, err), err


@pytest.mark.parametrize("name,content,message", [
    ("latin1.jsonl", '{"text": "caf\xe9"}\n'.encode("latin-1"), r"latin1.jsonl is not UTF-8 text .*save it as UTF-8"),
    ("latin1.txt", "caf\xe9".encode("latin-1"), r"latin1.txt is not UTF-8 text"),
    ("plain.jsonl.gz", b'{"text": "a"}\n', r"plain.jsonl.gz is not a complete gzip file .*drop the .gz suffix"),
])
def test_unreadable_data_files_are_named(full_vocab_checkpoint, tmp_path, capsys, name, content, message):
    f = tmp_path / name
    f.write_bytes(content)
    rc, err = run(small(full_vocab_checkpoint, tmp_path / "o", "--data", str(f), "--steps", "1"), capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and re.search(message, err), err


def test_prompt_sets_need_distinct_plain_ids(tmp_path):
    from spd_fast.config import SpdConfigError
    from spd_fast.train.data import load_prompts

    f = tmp_path / "p.jsonl"
    f.write_text('{"id": 1, "prompt": "a"}\n{"id": 2, "prompt": "b"}\n{"id": 1, "prompt": "c"}\n')
    with pytest.raises(SpdConfigError, match=r"rows 1 and 3 share the id 1; give each prompt its own id"):
        load_prompts(f)
    f.write_text('{"id": [1], "prompt": "a"}\n')
    with pytest.raises(SpdConfigError, match=r"row 1: \"id\" must be a string or an integer, got \[1\]"):
        load_prompts(f)
    f.write_text('{"id": "a", "prompt": "a"}\n{"id": 1, "prompt": "b"}\n')
    assert [r["id"] for r in load_prompts(f)] == ["a", 1]


def test_bad_options_and_paths(full_vocab_checkpoint, tmp_path, capsys, monkeypatch):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"Sample number {i} is here."}) + "\n" for i in range(4)))
    base = small(full_vocab_checkpoint, tmp_path / "o", "--data", str(data))
    for flag, value, message in [("--save-every", "0", "expected a positive integer, got 0"),
                                 ("--max-seq-len", "0", "expected a positive integer, got 0"),
                                 ("--draft-vocab", "0", "expected a positive integer, got 0"),
                                 ("--steps", "0", "expected a positive integer, got 0"),
                                 ("--epochs", "-1", "expected a finite number >= 0, got '-1'"),
                                 ("--boundaries", "0,x", "expected a comma-separated list like 0,10,20,30")]:
        rc, err = run(base + [flag, value], capsys)
        assert rc == 2 and message in err, (flag, err)
    rc, err = run(base + ["--boundaries", "0,3,6"], capsys)  # with --num-stages 3 from small()
    assert rc == 2 and "--boundaries 0,3,6 make 2 stages, not --num-stages 3; drop one of the two" in err
    rc, err = run(base + ["--epochs", "0.001"], capsys)
    assert rc == 2 and "--epochs 0.001 is less than one step" in err
    (tmp_path / "afile").write_text("x")
    rc, err = run(small(full_vocab_checkpoint, tmp_path / "afile", "--data", str(data)), capsys)
    assert rc == 2 and "is a file; pass a directory" in err
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")  # should "" be taken, the run lands here, not in the directory of the tests
    for empty in ("", " "):  # not the current directory
        argv = small(full_vocab_checkpoint, tmp_path / "o", "--data", str(data))
        argv[argv.index("--out") + 1] = empty
        rc, err = run(argv, capsys)
        assert rc == 2 and "--out is empty; name the run's directory" in err, err
    assert not list((tmp_path / "cwd").iterdir())
    rc, err = run(small(full_vocab_checkpoint, tmp_path / "o", "--data", str(tmp_path)), capsys)
    assert rc == 2 and f"data file {tmp_path} is a directory; pass its files" in err
    rc, err = run(base + ["--val", str(tmp_path)], capsys)
    assert rc == 2 and f"validation file {tmp_path} is a directory; pass a file" in err
    rc, err = run(small(full_vocab_checkpoint, tmp_path / "o", "--prompts", str(tmp_path / "nope.jsonl")), capsys)
    assert rc == 2 and "prompt file" in err and "nope.jsonl does not exist" in err
    assert not (tmp_path / "o").exists()  # a run refused before it wrote anything leaves no directory behind


def test_resume_refuses_another_head_and_a_fresh_start_drops_the_old_best(full_vocab_checkpoint, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"Sample number {i} is here, and more."}) + "\n" for i in range(6)))
    out = tmp_path / "o"
    base = small(full_vocab_checkpoint, out, "--data", str(data), "--val", str(data), "--steps", "2",
                 "--save-every", "2", "--draft-vocab", "49152")  # every validation row scored: a best head
    assert run(base, capsys)[0] == 0
    for extra, what in [(["--anchors", "0,1,3,6"], "anchors [0, 2, 4, 6] vs [0, 1, 3, 6]"),
                        (["--draft-layers", "2"], "num_layers 1 vs 2"),
                        (["--draft-vocab", "32"], "draft_vocab_size 49152 vs 32")]:
        rc, err = run(base + extra, capsys)
        assert rc == 2 and f"holds a run of another head ({what}: saved vs asked)" in err, err
        assert "pass --no-resume (or another --out) to start over" in err
    rc, err = run(base + ["--anchors", "0,1,3,6", "--no-resume"], capsys)
    assert rc == 0 and "removed" in err and "best_head of an earlier run" in err
    best = json.loads((out / "best_head" / "draft_config.json").read_text())
    assert best["anchors"] == [0, 1, 3, 6]


def test_a_time_budgeted_run_stays_finished_when_rerun(full_vocab_checkpoint, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"Sample number {i} is here, and more."}) + "\n" for i in range(6)))
    args = small(full_vocab_checkpoint, tmp_path / "o", "--data", str(data), "--steps", "100000",
                 "--time-budget", "2", "--save-every", "1000")
    assert run(args, capsys)[0] == 0
    first = torch.load(tmp_path / "o" / "trainer_state.pt", weights_only=False)
    assert 20 <= first["step"] < 100000 and first["budget_done"]
    rc, err = run(args, capsys)
    again = torch.load(tmp_path / "o" / "trainer_state.pt", weights_only=False)
    assert rc == 0 and f"resumed from {tmp_path / 'o'} at step {first['step']}" in err
    assert again["step"] == first["step"] == again["total_steps"]
    # every line of the log is a JSON object, the sentences too (a resumed log is read like a fresh one)
    lines = [json.loads(x) for x in (tmp_path / "o" / "train_log.jsonl").read_text().splitlines()]
    assert sum(x.get("resumed_at") == x.get("steps") == first["step"] for x in lines) == 1
    assert any("already finished" in x.get("message", "") for x in lines)


def test_self_distillation_answers_of_other_settings_are_not_reused(full_vocab_checkpoint, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"Say {i}."}) + "\n" for i in range(4)))
    base = small(full_vocab_checkpoint, tmp_path / "o", "--prompts", str(prompts), "--gen-batch", "4",
                 "--steps", "1", "--no-resume")
    assert run(base + ["--gen-max-new-tokens", "4"], capsys)[0] == 0
    rc, err = run(base + ["--gen-max-new-tokens", "6"], capsys)
    assert rc == 2 and "self_distill.jsonl holds answers made with other settings (max_new_tokens 4 vs 6)" in err
    rc, err = run(base + ["--gen-max-new-tokens", "4", "--dtype", "bfloat16"], capsys)  # the dtype is named
    assert rc == 2 and "other settings (model_identity " in err and "dtype 'float32' vs 'bfloat16'" in err, err
    rc, err = run(base + ["--gen-max-new-tokens", "4", "--max-prompts", "2"], capsys)
    assert rc == 0, err
    # the same weights under another config.json (RoPE base) answer differently: their answers are not reused,
    # though the sampled weights fingerprint that draft heads record is the same
    import shutil

    other = tmp_path / "other_rope"
    shutil.copytree(full_vocab_checkpoint, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["rope_parameters"]["rope_theta"] *= 2  # transformers 5 writes the RoPE base here
    (other / "config.json").write_text(json.dumps(cfg))
    out = small(str(other), tmp_path / "o", *base[base.index("--prompts"):], "--gen-max-new-tokens", "4")
    rc, err = run(out, capsys)
    assert rc == 2 and "self_distill.jsonl holds answers made with other settings (model_identity " in err, err
    assert "fingerprint" not in err.split("other settings")[1].split("model_identity")[0], err
    assert json.loads((tmp_path / "o" / "train_config.json").read_text())["samples"] == 2
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"Write {i}."}) + "\n" for i in range(4)))
    rc, err = run(base + ["--gen-max-new-tokens", "4"], capsys)
    assert rc == 2 and "answers prompt id 'p0' for another prompt text" in err


def test_epochs_under_torchrun_count_one_batch_per_rank(tiny_checkpoint, tmp_path):
    from test_distributed import free_port
    from test_train import _samples
    from conftest import tiny_target
    from spd_fast.train.trainer import pack_batches

    ckpt = tiny_checkpoint("llama")
    samples = _samples(tiny_target(ckpt), 8)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(s) + "\n" for s in samples))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    p = subprocess.run([str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", "2", "--master-port",
                        str(free_port()), "-m", "spd_fast.train", "--model", ckpt, "--out", str(tmp_path / "o"),
                        "--data", str(data), "--draft-vocab", "50", "--epochs", "1", "--batch-tokens", "64",
                        "--max-seq-len", "32", "--warmup", "1", "--no-feature-cache", "--threads", "1"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    per_rank = len(pack_batches(samples, 64, 32, 0, 0)) // 2
    assert per_rank >= 2
    assert torch.load(tmp_path / "o" / "trainer_state.pt", weights_only=False)["step"] == per_rank


def test_calibrate_and_eval_refuse_empty_grids_and_missing_prompts(capsys):
    from spd_fast.evaluate import load_eval_prompts
    from spd_fast.train.calibrate import main as cal_main
    from spd_fast.config import SpdConfigError

    with pytest.raises(SystemExit) as e:
        cal_main(["somewhere", "--scales", ""])
    assert e.value.code == 2 and "expected at least one number (comma-separated), got ''" in capsys.readouterr().err
    with pytest.raises(SpdConfigError, match="limit 100 is more than the 40 chat prompts there are"):
        load_eval_prompts(["chat"], 100)
    assert len(load_eval_prompts(["chat"], 40)["chat"]) == 40


def _text_rows(path: Path, n: int, word: str = "Sample") -> Path:
    path.write_text("".join(json.dumps({"text": f"{word} number {i} is here, and more."}) + "\n" for i in range(n)))
    return path


def test_a_rerun_on_other_data_is_refused_and_a_finished_run_trains_nothing(full_vocab_checkpoint, tmp_path, capsys):
    """Resuming checks the data as well as the head: other data would silently train the rest of the old run's
    schedule (or nothing, once it has finished) and keep the old head."""
    out = tmp_path / "o"
    d1, d2 = _text_rows(tmp_path / "a.jsonl", 6), _text_rows(tmp_path / "b.jsonl", 5, "Other")
    base = small(full_vocab_checkpoint, out, "--steps", "2", "--save-every", "2")
    assert run(base + ["--data", str(d1)], capsys)[0] == 0
    weights = (out / "head" / "draft.safetensors").read_bytes()
    rc, err = run(base + ["--data", str(d1)], capsys)
    assert rc == 0 and f"the run in {out} had already finished (2 steps): nothing to train" in err
    assert (out / "head" / "draft.safetensors").read_bytes() == weights
    rc, err = run(base + ["--data", str(d2)], capsys)
    assert rc == 2 and f"{out} holds a run trained on other data (6 samples" in err and "now 5" in err, err
    assert "pass the run's own --data (same files, same order) and --max-seq-len (it decides which samples are " \
           "kept), or --no-resume" in err
    rc, err = run(base + ["--data", str(d1), "--data", str(d2)], capsys)
    assert rc == 2 and "now 11" in err
    errors = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines() if '"error"' in line]
    assert len(errors) == 2 and "now 11" in errors[-1]["error"]  # the run's log keeps why each attempt stopped
    assert run(base + ["--data", str(d2), "--no-resume"], capsys)[0] == 0
    assert (out / "head" / "draft.safetensors").read_bytes() != weights


def test_max_seq_len_drops_samples_it_leaves_no_answer_in(full_vocab_checkpoint, tmp_path, capsys):
    long_prompt = {"messages": [{"role": "user", "content": "word " * 60}, {"role": "assistant", "content": "Ok."}]}
    data = tmp_path / "c.jsonl"
    data.write_text(json.dumps(long_prompt) + "\n")
    rc, err = run(small(full_vocab_checkpoint, tmp_path / "o", "--data", str(data), "--steps", "1"), capsys)
    assert rc == 2 and "--max-seq-len 64 leaves no answer token of any of the 1 samples inside the window" in err
    shortest = int(re.search(r"the shortest prompt has (\d+) tokens", err).group(1))
    assert f"raise --max-seq-len to at least {shortest + 1}" in err and shortest > 64
    data.write_text(json.dumps(long_prompt) + "\n" + "".join(json.dumps(r) + "\n" for r in CHAT)
                    + json.dumps({"text": "long " * 100}) + "\n")
    rc, err = run(small(full_vocab_checkpoint, tmp_path / "o", "--data", str(data), "--steps", "1"), capsys)
    assert rc == 0, err
    assert '{"max_seq_len": 64, "dropped_samples": 1, "cut_samples": 1}' in err
    assert json.loads((tmp_path / "o" / "train_config.json").read_text())["samples"] == 4  # 3 chat turns + 1 text


def test_a_tokenizer_of_another_model_is_named_for_text_data(tiny_checkpoint, tmp_path, capsys):
    """The tiny checkpoints have 97 token ids and the default model's tokenizer: text data must be refused with
    the tokenizer named, not crash inside training."""
    for name, content in [("t.jsonl", json.dumps({"text": "Hello there, world."}) + "\n"),
                          ("c.jsonl", json.dumps(CHAT[0]) + "\n"), ("p.txt", "Hello there, world.\n")]:
        (tmp_path / name).write_text(content)
        rc, err = run(small(tiny_checkpoint("llama"), tmp_path / "o", "--data", str(tmp_path / name)), capsys)
        assert rc == 2 and "outside the model's vocabulary (0..96), so it does not match the model" in err, err
        assert name in err


def test_parquet_text_must_be_strings(full_vocab_checkpoint, tmp_path, capsys, monkeypatch):
    import types

    class Frame:
        columns = ["text"]

        def __getitem__(self, key):
            return ["A fine row.", None]

    monkeypatch.setitem(sys.modules, "pandas", types.SimpleNamespace(read_parquet=lambda path: Frame()))
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    rc, err = run(small(full_vocab_checkpoint, tmp_path / "o", "--data", str(tmp_path / "d.parquet")), capsys)
    assert rc == 2 and "d.parquet, row 2: the \"text\" column holds None, not a string; drop or fill" in err


def test_self_distillation_needs_a_chat_template_and_a_readable_settings_file(full_vocab_checkpoint, tmp_path,
                                                                              capsys):
    import shutil

    base_model = tmp_path / "base"
    shutil.copytree(full_vocab_checkpoint, base_model)
    (base_model / "chat_template.jinja").unlink(missing_ok=True)
    tc = json.loads((base_model / "tokenizer_config.json").read_text())
    tc.pop("chat_template", None)
    (base_model / "tokenizer_config.json").write_text(json.dumps(tc))
    rc, err = run(small(str(base_model), tmp_path / "o", "--max-prompts", "2", "--steps", "1"), capsys)
    assert rc == 2 and "has no chat template (a base model?); train on text instead: --data FILE" in err, err

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"Say {i}."}) + "\n" for i in range(2)))
    args = small(full_vocab_checkpoint, tmp_path / "o2", "--prompts", str(prompts), "--gen-max-new-tokens", "4",
                 "--steps", "1")
    assert run(args, capsys)[0] == 0
    meta = tmp_path / "o2" / "self_distill.jsonl.meta.json"
    assert json.loads(meta.read_text())["max_new_tokens"] == 4 and not list((tmp_path / "o2").glob("*.tmp"))
    meta.write_text("")  # what a kill in the middle of the old, non-atomic write left
    rc, err = run(args, capsys)
    assert rc == 2 and "self_distill.jsonl.meta.json (the settings of the answers in self_distill.jsonl) is " \
                       "unreadable; delete both files" in err


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit) as e:
        train_main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    flat = " ".join(text.split())
    for piece in ["--draft-layers DRAFT_LAYERS L_s, decoder layers of the head (default: 1)",
                  "(default: 16384)", "--max-seq-len MAX_SEQ_LEN tokens of each sample", "(default: 512)",
                  "--max-prompts MAX_PROMPTS use only the first N prompts (0 = all) (default: 0)",
                  "--steps STEPS optimizer steps (the LR schedule's length) (default: 1000)", "OUT/best_head"]:
        assert piece in flat, piece
    assert "(default: None)" not in flat and "(default: False)" not in flat


def _varied_rows(path: Path, n: int, seed: int = 1) -> Path:
    import random

    rng = random.Random(seed)
    words = "the cat sat on a mat while dogs ran far away from home and birds sang songs in tall green trees".split()
    path.write_text("".join(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(2, 40)))}) + "\n"
                            for _ in range(n)))
    return path


def test_a_resume_across_epochs_takes_the_batches_of_an_uninterrupted_run(full_vocab_checkpoint, tmp_path, capsys,
                                                                         monkeypatch):
    """Each epoch packs its batches anew, so epochs differ in batch count: a resume must find its place from the
    epochs' own counts (not the first epoch's count times the epoch), and --epochs must count them the same way."""
    from spd_fast.train import trainer as T

    data = _varied_rows(tmp_path / "d.jsonl", 80)

    def args(out: str) -> list[str]:
        return small(full_vocab_checkpoint, tmp_path / out, "--data", str(data), "--epochs", "4", "--save-every", "5")

    seen: dict[str, list] = {}
    orig, state = T.PdmTrainer.train_step, {"run": "", "stop_at": -1}

    def record(self, batch, cached=None):
        if self.step == state["stop_at"]:
            raise KeyboardInterrupt
        seen.setdefault(state["run"], []).append((self.step, batch[0].sum().item(), tuple(batch[0].shape)))
        return orig(self, batch, cached)

    monkeypatch.setattr(T.PdmTrainer, "train_step", record)
    per_epoch: dict[int, int] = {}
    pack = T.pack_batches

    def counting_pack(samples, *a):
        out = pack(samples, *a)
        per_epoch[a[-1]] = len(out)
        return out

    monkeypatch.setattr(T, "pack_batches", counting_pack)
    state["run"] = "whole"
    assert run(args("a"), capsys)[0] == 0
    steps = len(seen["whole"])
    assert steps == sum(per_epoch[e] for e in range(4)) != 4 * per_epoch[0], per_epoch  # the counts differ
    state.update(run="first", stop_at=steps - 3)  # stopped after the last checkpoint before the end
    with pytest.raises(KeyboardInterrupt):
        run(args("b"), capsys)
    state.update(run="rest", stop_at=-1)
    assert run(args("b"), capsys)[0] == 0
    whole = dict((st, rest) for st, *rest in seen["whole"])
    resumed = seen["rest"]
    assert resumed and all(whole[st] == rest for st, *rest in resumed), "a resumed step took another batch"
    a = torch.load(tmp_path / "a" / "trainer_state.pt", weights_only=False)["head"]
    b = torch.load(tmp_path / "b" / "trainer_state.pt", weights_only=False)["head"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_epoch_step_counting():
    from spd_fast.train.trainer import epoch_steps, locate_step

    per = {0: 12, 1: 11, 2: 13, 3: 12}.__getitem__
    assert epoch_steps(per, 2) == 23 and epoch_steps(per, 2.5) == 23 + 6 and epoch_steps(per, 0.5) == 6
    assert [locate_step(per, s) for s in (0, 11, 12, 22, 23, 35, 36)] == \
        [(0, 0), (0, 11), (1, 0), (1, 10), (2, 0), (2, 12), (3, 0)]


def test_a_finished_rerun_keeps_the_head_and_its_calibration(full_vocab_checkpoint, tmp_path, capsys):
    out = tmp_path / "o"
    argv = small(full_vocab_checkpoint, out, "--data", str(_text_rows(tmp_path / "d.jsonl", 6)), "--steps", "2",
                 "--save-every", "2")
    assert run(argv, capsys)[0] == 0
    cfg = json.loads((out / "head" / "draft_config.json").read_text())
    cfg["draft_temperature_scale"] = 0.5  # what `calibrate --write` stores in the head
    (out / "head" / "draft_config.json").write_text(json.dumps(cfg))
    rc, err = run(argv, capsys)
    assert rc == 0 and "nothing to train" in err
    assert json.loads((out / "head" / "draft_config.json").read_text())["draft_temperature_scale"] == 0.5


def test_validation_edge_cases(full_vocab_checkpoint, tmp_path, capsys):
    """No validation row inside --max-seq-len is an error (it would score a perfect 0 loss); a validation the run
    missed (stopped during it) is done at the resume; a damaged best_head/val.json is no best yet."""
    data = _text_rows(tmp_path / "d.jsonl", 6)
    long_val = tmp_path / "v.jsonl"  # a long system prompt puts every answer token past --max-seq-len
    long_val.write_text(json.dumps({"messages": [{"role": "system", "content": "word " * 200},
                                                 {"role": "user", "content": "Hi"},
                                                 {"role": "assistant", "content": "Hello there."}]}) + "\n")
    rc, err = run(small(full_vocab_checkpoint, tmp_path / "o", "--data", str(data), "--val", str(long_val),
                        "--max-seq-len", "16"), capsys)
    assert rc == 2 and "--max-seq-len 16 leaves no answer token of any of the 1 validation samples" in err, err
    val = _text_rows(tmp_path / "val.jsonl", 3, "Held")
    out = tmp_path / "r"
    argv = small(full_vocab_checkpoint, out, "--data", str(data), "--val", str(val), "--steps", "2", "--save-every", "2",
                 "--draft-vocab", "49152")  # every validation row scored
    assert run(argv, capsys)[0] == 0
    (out / "last_val.json").write_text(json.dumps({"step": 0}))  # as if the run had stopped during that validation
    (out / "best_head" / "val.json").write_text("")              # and the write of its record had been cut short
    rc, err = run(argv, capsys)
    assert rc == 0 and '"step": 2' in err and '"best": true' in err and "nothing to train" in err, err
    assert json.loads((out / "best_head" / "val.json").read_text())["step"] == 2


def test_resume_takes_this_runs_weight_decay(full_vocab_checkpoint, tmp_path, capsys, monkeypatch):
    from spd_fast.train import trainer as T

    data = _text_rows(tmp_path / "d.jsonl", 6)
    out = tmp_path / "o"
    assert run(small(full_vocab_checkpoint, out, "--data", str(data), "--steps", "2", "--save-every", "2"), capsys)[0] == 0
    used = []
    orig = T.PdmTrainer.train_step
    monkeypatch.setattr(T.PdmTrainer, "train_step",
                        lambda self, *a: used.append([g["weight_decay"] for g in self.opt.param_groups]) or orig(self, *a))
    assert run(small(full_vocab_checkpoint, out, "--data", str(data), "--steps", "3", "--weight-decay", "0.5"),
               capsys)[0] == 0
    assert used and all(w == 0.5 for w in used[0])


def test_teacher_cache_needs_room_on_disk(full_vocab_checkpoint, tmp_path, capsys, monkeypatch):
    """The memory-mapped cache files are sparse: a full disk would kill the run with SIGBUS and no message."""
    from collections import namedtuple

    from spd_fast.train import features

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(features.shutil, "disk_usage", lambda p: usage(10, 10, 1000))
    argv = [a for a in small(full_vocab_checkpoint, tmp_path / "o", "--data", str(_text_rows(tmp_path / "d.jsonl", 6)),
                             "--steps", "1") if a != "--no-feature-cache"]
    rc, err = run(argv, capsys)
    assert rc == 2 and "the teacher feature cache needs" in err and "only 0.00 GiB is free" in err, err
    assert "--no-feature-cache" in err and len(err.strip().splitlines()) == 1
    monkeypatch.undo()
    rc, err = run(argv, capsys)
    assert rc == 0, err


def test_a_damaged_parquet_file_is_named(full_vocab_checkpoint, tmp_path, capsys, monkeypatch):
    import sys
    import types

    fake = types.ModuleType("pandas")

    def read_parquet(path):
        raise ValueError("Parquet magic bytes not found in footer. Either the file is corrupted or this is not a "
                         "parquet file.")

    fake.read_parquet = read_parquet
    monkeypatch.setitem(sys.modules, "pandas", fake)
    f = tmp_path / "d.parquet"
    f.write_text("not parquet")
    rc, err = run(small(full_vocab_checkpoint, tmp_path / "o", "--data", str(f), "--steps", "1"), capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert f"data file {f} cannot be read as parquet (ValueError: Parquet magic bytes not found" in err, err
    assert not (tmp_path / "o").exists()


def test_a_fresh_start_drops_the_discarded_runs_state(full_vocab_checkpoint, tmp_path, capsys, monkeypatch):
    """--no-resume used to leave the old trainer_state.pt until the new run's first checkpoint: a run stopped
    before it, then started again without --no-resume, resumed the run the user had discarded."""
    from spd_fast.train import trainer as trmod

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in CHAT))
    out = tmp_path / "o"
    assert run(small(full_vocab_checkpoint, out, "--data", str(data), "--steps", "2"), capsys)[0] == 0
    assert (out / "trainer_state.pt").is_file()

    def stop(self, *a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(trmod.PdmTrainer, "train_step", stop)
    with pytest.raises(KeyboardInterrupt):
        train_main(small(full_vocab_checkpoint, out, "--data", str(data), "--steps", "5", "--no-resume"))
    assert not (out / "trainer_state.pt").exists()


@pytest.mark.parametrize("extra, message", [
    (["--seed", str(10 ** 30)], "seed 1000000000000000000000000000000 is out of range; use an integer in [-2**63"),
    (["--prompts", "/nonexistent.jsonl"], "--prompts only apply to --data self-distill, which this run does not use"),
    (["--max-prompts", "5", "--gen-temperature", "0.7"], "--max-prompts, --gen-temperature only apply to --data "
                                                         "self-distill"),
    (["--lr", "0"], "--lr: expected a finite number > 0, got '0'"),
    (["--fill-after-miss", "--fill-aug", "0"], "--fill-after-miss only shapes the fill-augmented steps, which "
                                               "--fill-aug 0 turns off; drop it or give --fill-aug a probability > 0"),
    (["--fill-after-miss", "--num-stages", "1"], "which a 1-stage head never takes; drop it"),
    (["--val-limit", "3"], "--val-limit only applies to --val files, and none was given; drop it or add --val"),
    (["--max-seq-len", "600"], "--max-seq-len 600 is longer than the model's context (512 positions); pass "
                               "--max-seq-len 512 or less"),
])
def test_options_out_of_range_or_for_another_data_source_are_refused(full_vocab_checkpoint, tmp_path, capsys, extra,
                                                                     message):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in CHAT))
    rc, err = run(small(full_vocab_checkpoint, tmp_path / "o", "--data", str(data), "--steps", "1", *extra), capsys)
    assert rc == 2 and message in err, err


def test_out_under_a_file_and_a_validation_set_of_empty_answers_are_refused(full_vocab_checkpoint, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in CHAT))
    rc, err = run(small(full_vocab_checkpoint, data / "sub", "--data", str(data), "--steps", "1"), capsys)
    assert rc == 2 and f"cannot create --out {data / 'sub'} (Not a directory); choose another path" in err, err
    val = tmp_path / "v.jsonl"
    val.write_text(json.dumps({"text": ""}) + "\n" + json.dumps({"prompt_ids": [1, 2], "response_ids": []}) + "\n")
    rc, err = run(small(full_vocab_checkpoint, tmp_path / "o", "--data", str(data), "--steps", "1", "--val", str(val)),
                  capsys)
    assert rc == 2 and "every --val sample has an empty answer" in err, err


def test_prompt_files_that_hold_nothing_or_are_directories_are_named(tmp_path):
    from spd_fast.config import SpdConfigError
    from spd_fast.train.data import load_prompts

    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(SpdConfigError, match=r"prompt file .*empty.jsonl holds no prompts"):
        load_prompts(tmp_path / "empty.jsonl")
    with pytest.raises(SpdConfigError, match=r"prompt file .* is a directory; pass a .jsonl file"):
        load_prompts(tmp_path)
    (tmp_path / "sur.jsonl").write_text('{"id": 1, "prompt": "ok"}\n{"id": 2, "prompt": "cut \\ud83d"}\n')
    with pytest.raises(SpdConfigError, match=r"sur.jsonl, row 2: the prompt is not valid Unicode text: '\\ud83d' at "
                                             r"character 4 is a lone surrogate"):
        load_prompts(tmp_path / "sur.jsonl")


def test_data_files_with_a_byte_order_mark_a_corrupt_gzip_or_a_cut_last_line(tmp_path):
    """A UTF-8 byte-order mark is not data; a gzip whose stream is damaged mid-way is named (zlib.error was a
    traceback); a self-distillation file cut mid-line by a killed run is trimmed back to its last whole line."""
    import gzip

    from spd_fast.config import SpdConfigError
    from spd_fast.train.data import _drop_partial_line, read_jsonl

    rows = [{"id": str(i), "prompt": "x" * 50 + str(i)} for i in range(400)]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (tmp_path / "bom.jsonl").write_text("\ufeff" + text, encoding="utf-8")
    assert read_jsonl(tmp_path / "bom.jsonl") == rows
    raw = bytearray(gzip.compress(text.encode()))
    raw[len(raw) // 2: len(raw) // 2 + 8] = b"\xff" * 8
    (tmp_path / "bad.jsonl.gz").write_bytes(bytes(raw))
    with pytest.raises(SpdConfigError, match=r"bad.jsonl.gz is not a complete gzip file"):
        read_jsonl(tmp_path / "bad.jsonl.gz")
    cut = tmp_path / "sd.jsonl"
    cut.write_text(text + '{"id": "400", "pro')
    _drop_partial_line(cut)
    assert cut.read_text() == text and read_jsonl(cut) == rows
    _drop_partial_line(cut)  # a whole file stays as it is
    assert cut.read_text() == text
    cut.write_text('{"id": "0", "pro')  # no whole line at all
    _drop_partial_line(cut)
    assert cut.read_text() == ""


def test_a_step_without_loss_rows_is_reported_once(full_vocab_checkpoint, tmp_path, capsys):
    """With a draft vocabulary that holds none of the target's argmax tokens every step learns nothing: the run
    says so once, instead of logging a loss of 0 with no word why."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in CHAT))
    argv = small(full_vocab_checkpoint, tmp_path / "o", "--data", str(data), "--steps", "3")
    rc, err = run([a if a != "64" or argv[i - 1] != "--draft-vocab" else "1" for i, a in enumerate(argv)], capsys)
    assert rc == 0, err
    assert err.count("had no loss row: no answer token of its batch has its target argmax in the 1-token draft "
                     "vocabulary, so it learnt nothing; raise --draft-vocab") == 1, err
    rc, err = run(small(full_vocab_checkpoint, tmp_path / "o2", "--data", str(data), "--steps", "2",
                        "--draft-vocab", "49152"), capsys)
    assert rc == 0 and "had no loss row" not in err, err


def test_a_resumed_init_run_needs_no_init_dir_and_other_val_data_rescore_the_best(full_vocab_checkpoint, tmp_path,
                                                                                  capsys):
    """A resume takes the head from its checkpoint, so the --init directory may be gone by then; a resume with
    other --val data scores the kept best head on them before a checkpoint is judged against it."""
    import shutil

    data = _text_rows(tmp_path / "d.jsonl", 6)
    base_out = tmp_path / "base"
    assert run(small(full_vocab_checkpoint, base_out, "--data", str(data), "--steps", "1", "--draft-vocab", "49152"),
               capsys)[0] == 0
    init = tmp_path / "init"
    shutil.copytree(base_out / "head", init)
    val_a, val_b = _text_rows(tmp_path / "va.jsonl", 3, "Held"), _text_rows(tmp_path / "vb.jsonl", 4, "Other")
    out = tmp_path / "o"
    argv = small(full_vocab_checkpoint, out, "--data", str(data), "--init", str(init), "--save-every", "2",
                 "--draft-vocab", "49152")  # every validation row scored
    assert run(argv + ["--val", str(val_a), "--steps", "2"], capsys)[0] == 0
    best_a = json.loads((out / "best_head" / "val.json").read_text())
    shutil.rmtree(init)
    rc, err = run(argv + ["--val", str(val_b), "--steps", "4"], capsys)
    assert rc == 0 and f"resumed from {out} at step 2" in err, err
    assert f"{out / 'best_head'} (step {best_a['step']}) was chosen on other validation data" in err, err
    rec = json.loads((out / "best_head" / "val.json").read_text())
    assert rec["val_data"] != best_a["val_data"] and rec["val_data"]["samples"] == 4  # the data it was scored on


def test_a_time_budget_counts_the_time_a_resumed_run_spent(full_vocab_checkpoint, tmp_path, capsys, monkeypatch):
    """A run stopped before its budget fitted the step count used to get the whole budget again at its resume."""
    from spd_fast.train import trainer as trmod

    out = tmp_path / "o"
    argv = small(full_vocab_checkpoint, out, "--data", str(_text_rows(tmp_path / "d.jsonl", 6)), "--steps", "100000",
                 "--time-budget", "600", "--save-every", "5")
    real = trmod.PdmTrainer.train_step

    def stop_at_12(self, *a, **k):
        if self.step == 12:
            raise KeyboardInterrupt  # the end of a session, before the budget fitted the run (step 20)
        return real(self, *a, **k)

    monkeypatch.setattr(trmod.PdmTrainer, "train_step", stop_at_12)
    with pytest.raises(KeyboardInterrupt):
        train_main(argv)
    monkeypatch.setattr(trmod.PdmTrainer, "train_step", real)
    st = torch.load(out / "trainer_state.pt", weights_only=False)
    assert st["step"] == 10 and not st["budget_done"] and 0 < st["train_seconds"] < 600
    st["train_seconds"] = 590.0  # as if the earlier sessions had spent nearly all of it
    torch.save(st, out / "trainer_state.pt")
    rc, err = run(argv, capsys)
    again = torch.load(out / "trainer_state.pt", weights_only=False)
    assert rc == 0 and again["budget_done"] and again["step"] == again["total_steps"] == 30, err
    assert again["train_seconds"] > 590.0


def test_greedy_answers_are_reused_under_another_seed_and_free_their_caches(full_vocab_checkpoint, tmp_path, capsys):
    """Greedy self-distilled answers (no generator draws them) were refused after a --seed change, with advice to
    delete and regenerate byte-identical answers; sampled ones still are. The generation-sized KV caches that
    self-distillation left behind then sized the first teacher batch of the cache build (28x its need)."""
    from spd_fast.runtime import load_target
    from spd_fast.train.data import self_distill
    from spd_fast.train.features import build_feature_cache

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"Say {i}."}) + "\n" for i in range(4)))
    base = small(full_vocab_checkpoint, tmp_path / "o", "--prompts", str(prompts), "--gen-batch", "4",
                 "--gen-max-new-tokens", "4", "--steps", "1", "--no-resume")
    assert run(base, capsys)[0] == 0
    answers = (tmp_path / "o" / "self_distill.jsonl").read_bytes()
    rc, err = run(base + ["--seed", "7"], capsys)
    assert rc == 0, err
    assert (tmp_path / "o" / "self_distill.jsonl").read_bytes() == answers  # reused, not made again
    sampled = small(full_vocab_checkpoint, tmp_path / "s", *base[base.index("--prompts"):], "--gen-temperature", "0.7")
    assert run(sampled + ["--seed", "1"], capsys)[0] == 0
    rc, err = run(sampled + ["--seed", "2"], capsys)
    assert rc == 2 and "holds answers made with other settings (seed 1 vs 2)" in err, err

    target = load_target(full_vocab_checkpoint)
    m = target.model
    self_distill(target, [{"id": "q", "prompt": "Say hi."}], tmp_path / "sd.jsonl", max_new_tokens=4, batch_size=64,
                 progress=False)
    assert m.layers[0].attn.k_cache is None and m.max_len == 0  # freed
    m.setup_caches(64, 300)  # as a generation pass leaves them
    sizes = []
    real = m.setup_caches
    m.setup_caches = lambda b, n: sizes.append((b, n)) or real(b, n)
    rows = [json.loads(x) for x in (tmp_path / "o" / "self_distill.jsonl").read_text().splitlines()]
    build_feature_cache(m, "fp", rows, tmp_path / "fc", (0, 1, 2), 64, progress=False)
    longest = max(len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows)
    assert sizes and all(n <= longest for _, n in sizes), (sizes, longest)
