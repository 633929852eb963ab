"""scripts/train_tokenizer.py on bad input: one `error:` line in plain words on stderr, exit code 2,
no traceback, and nothing left on disk (no output folder it made, no temporary file)."""
from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

pytest.importorskip("sentencepiece")

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(REPO, "scripts", "train_tokenizer.py")
sys.path.insert(0, os.path.join(REPO, "scripts"))


def run(*args, cwd):
    p = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, cwd=str(cwd),
                       timeout=120, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    return p, errors


def tree(root) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, n), root) for d, ds, fs in os.walk(root) for n in ds + fs)


def small_text(path):
    path.write_text("hello world\nthe cat sat on the mat\n")
    return str(path)


def test_no_matching_input_is_exit_2(tmp_path):
    p, errors = run("--input", "nothing*.txt", "--vocab-size", "400", "--output", "tok/t", cwd=tmp_path)
    assert p.returncode == 2 and errors == ["error: no file matches 'nothing*.txt'"], p.stderr
    p, errors = run("--input", "absent.txt", "--vocab-size", "400", "--output", "tok/t", cwd=tmp_path)
    assert p.returncode == 2 and errors == ["error: input file not found: absent.txt"], p.stderr
    assert tree(tmp_path) == []


def test_vocabulary_too_large_for_the_text_is_one_plain_line(tmp_path):
    small_text(tmp_path / "small.txt")
    p, errors = run("--input", "small.txt", "--vocab-size", "4000", "--output", "new/dir/tok", cwd=tmp_path)
    assert p.returncode == 2 and len(errors) == 1, p.stderr
    assert errors[0].startswith("error: the text has only ") and "--vocab-size 4000 is too large" in errors[0]
    n = int(errors[0].split("the text has only ")[1].split()[0])
    assert 300 <= n < 4000 and f"try --vocab-size {n} or less" in errors[0], errors[0]
    assert "INTERNAL" not in p.stderr and "trainer_interface" not in p.stderr and "Traceback" not in p.stderr
    assert tree(tmp_path) == ["small.txt"]        # the folders it made are gone, no temporary file
    # into a folder that exists: it is kept, with what it held, and nothing is added
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    p, errors = run("--input", "small.txt", "--vocab-size", "4000", "--output", "out/tok", cwd=tmp_path)
    assert p.returncode == 2 and len(errors) == 1, p.stderr
    assert tree(tmp_path / "out") == ["keep.txt"]
    # the suggested size works
    p, errors = run("--input", "small.txt", "--vocab-size", str(n), "--output", "out/tok", cwd=tmp_path)
    assert p.returncode == 0 and not errors, p.stderr
    assert tree(tmp_path / "out") == ["keep.txt", "tok.model", "tok.vocab"]


def test_other_bad_input_is_exit_2(tmp_path):
    text = small_text(tmp_path / "small.txt")
    (tmp_path / "empty.txt").write_text("\n  \n")
    (tmp_path / "afile").write_text("x")
    rng = random.Random(0)
    chars = [chr(0x4E00 + i) for i in range(600)]   # more characters than pieces
    (tmp_path / "cjk.txt").write_text("\n".join("".join(rng.choice(chars) for _ in range(40)) for _ in range(100)))
    cases = [
        (["--input", text, "--vocab-size", "200", "--output", "tok/t"], "error: --vocab-size must be at least 300"),
        (["--input", "empty.txt", "--vocab-size", "400", "--output", "tok/t"], "error: the input files contain no text"),
        (["--input", text, "--vocab-size", "400", "--output", "afile/sub/t"], "error: --output: "),
        (["--input", "cjk.txt", "--vocab-size", "400", "--output", "tok/t"], "error: --vocab-size 400 is too small"),
        (["--vocab-size", "400", "--output", "tok/t"], "error: the following arguments are required: --input"),
    ]
    before = tree(tmp_path)
    for args, start in cases:
        p, errors = run(*args, cwd=tmp_path)
        assert p.returncode == 2 and len(errors) == 1 and errors[0].startswith(start), (args, p.stderr)
        assert len(p.stderr.splitlines()) == 1, (args, p.stderr)   # no usage block either
        assert "Traceback" not in p.stderr and "INTERNAL" not in p.stderr
        assert tree(tmp_path) == before, args


def test_train_raises_a_system_exit_with_the_error_line(tmp_path):
    """prepare_quickstart_data.py calls train() and prints a SystemExit's code: it stays that line."""
    import train_tokenizer

    with pytest.raises(SystemExit) as e:
        train_tokenizer.train([small_text(tmp_path / "small.txt")], 4000, str(tmp_path / "tok" / "t"), threads=1)
    assert isinstance(e.value.code, str) and e.value.code.startswith("error: the text has only ")
    assert tree(tmp_path) == ["small.txt"]
