"""Bad configuration values and bad data files: one clear line on stderr, exit code 2, no traceback."""
import os
import re

import pytest

from hsgd.model.config import ModelConfig
from hsgd.model.data import Corpus
from hsgd.errors import ConfigError, DataError
from hsgd.step.settings import TrainConfig


BAD_FLAGS = [
    (["--n-heads", "3"], "d_model=8 is not divisible by n_heads=3"),
    (["--steps", "0"], "steps=0 must be a positive integer"),
    (["--batch-size", "-2"], "batch_size=-2 must be a positive integer"),
    (["--lr", "-1"], "lr=-1.0 must be > 0"),
    (["--momentum", "1.5"], "momentum=1.5 must be in [0, 1)"),
    (["--eval-interval", "-1"], "eval_interval=-1 must be an integer >= 0"),
    (["--data", "/nonexistent/corpus.txt"], "does not exist"),
]


@pytest.fixture(scope="module")
def bad_flag_runs(tmp_path_factory):
    """python -m hsgd.train's main with tiny settings plus each case's flags, all in one process
    (tests/test_bad_inputs.run_all): {flags: (exit code, stderr)}; BAD_FLAGS, an unparsable value and a corpus of
    3 bytes ("short")."""
    from .test_bad_inputs import run_all
    short = tmp_path_factory.mktemp("short") / "short.txt"
    short.write_bytes(b"abc")
    cases = [tuple(f) for f, _ in BAD_FLAGS] + [("--steps", "many"), ("--data", str(short))]
    runs = dict(zip(cases, run_all(cases)))
    runs["short"] = runs.pop(("--data", str(short)))
    return runs


@pytest.mark.parametrize("flags, words", BAD_FLAGS)
def test_bad_flags_exit_2_with_one_line(flags, words, bad_flag_runs):
    code, err = bad_flag_runs[tuple(flags)]
    print(f"{flags} -> exit {code}: {err.strip()}")
    assert code == 2
    assert err.startswith("hsgd: error: ") and words in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_unparsable_flag_is_a_usage_error(bad_flag_runs):
    code, err = bad_flag_runs[("--steps", "many")]
    assert code == 2 and "invalid int value: 'many'" in err and "Traceback" not in err


def test_bad_data_files(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    short = tmp_path / "short.txt"
    short.write_bytes(b"0123456789")
    cases = [(str(tmp_path / "missing.txt"), "does not exist"),
             (str(tmp_path), "is a directory"),
             (str(empty), "is empty"),
             (str(short), "has 10 bytes, fewer than seq_len + 1 = 65")]
    for path, words in cases:
        with pytest.raises(DataError, match=re.escape(words)) as e:
            Corpus.load(path, seq_len=64)
        print(f"{os.path.basename(path)}: {e.value}")
    # exactly seq_len + 1 bytes is enough (validation then shares the training text)
    c = Corpus.load(str(short), seq_len=9)
    assert c.shared_split and c.batch(0, 0, 2)[0].shape == (2, 9)


def test_unreadable_data_file(tmp_path, monkeypatch):
    path = tmp_path / "secret.txt"
    path.write_bytes(b"x" * 100)
    real_open = open

    def deny(file, *args, **kwargs):
        if str(file) == str(path):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr("builtins.open", deny)
    with pytest.raises(DataError, match="cannot be read \\(Permission denied\\)"):
        Corpus.load(str(path), seq_len=8)


def test_too_short_file_from_the_command_line(bad_flag_runs):
    code, err = bad_flag_runs["short"]
    assert code == 2 and "has 3 bytes, fewer than seq_len + 1 = 9" in err and "--seq-len" in err


def test_config_errors_name_field_value_and_fix():
    with pytest.raises(ConfigError, match=r"n_layers=0 must be a positive integer"):
        ModelConfig(n_layers=0)
    with pytest.raises(ConfigError, match=r"d_model=12 is not divisible by n_heads=5; .*\[1, 2, 3, 4, 6, 12\]"):
        ModelConfig(d_model=12, n_heads=5)
    with pytest.raises(ConfigError, match="dtype='float8' is not supported"):
        TrainConfig(dtype="float8").validate()
    with pytest.raises(ConfigError, match="device='tpu' is not known"):
        TrainConfig(device="tpu").validate()


def test_checkpoints_are_ordered_by_step_number(tmp_path):
    from hsgd.checkpoint.runs import complete_checkpoints
    for step in (999999, 1000000, 7):
        (tmp_path / f"step-{step:06d}").mkdir()
        (tmp_path / f"step-{step:06d}" / "manifest.json").write_text("{}")
    (tmp_path / "step-000008").mkdir()                                  # no manifest: incomplete, ignored
    names = [p.rsplit("/", 1)[1] for p in complete_checkpoints(str(tmp_path))]
    assert names == ["step-000007", "step-999999", "step-1000000"]
