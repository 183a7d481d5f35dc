"""Settings from a TOML file (`--config FILE.toml`): the flags' names with underscores as keys, each value checked
against its field's type before it is used (a string "no" for a switch would count as on, an integer path would be
used as a file descriptor, a string number would fail deep inside the run)."""
from dataclasses import fields

from hsgd.model.config import ModelConfig, flag_names
from hsgd.errors import ConfigError
from hsgd.readers import read_toml as read_bounded_toml


def load_toml(path, what, error):
    """The table in the TOML file at `path`, or error(...) naming `what` ("config file", "hardware file") when it is
    not a regular file, not UTF-8 text, not TOML, or beyond the bounds of hsgd.readers.read_toml (1 MiB, 64 levels of
    nesting, integers of 20 digits, finite floats)."""
    return read_bounded_toml(path, what, error)


def read_toml(path):
    """The settings in a TOML file, checked against the known keys and their types."""
    from hsgd.step.settings import TrainConfig                            # (settings imports this module)
    table = load_toml(path, "config file", ConfigError)
    if "grad_accum" in table:
        raise ConfigError(f"config file {path!r}: grad_accum is now micro_batches (micro-batches per DP group and "
                          "step); rename the key")
    types = {f.name: f.type for f in fields(TrainConfig)} | {f.name: f.type for f in fields(ModelConfig)}
    known = {f.name for f in fields(TrainConfig)} | set(flag_names(ModelConfig))
    unknown = sorted(set(table) - known)
    if unknown:
        raise ConfigError(f"config file {path!r} has unknown keys {unknown}; known keys: {sorted(known)}")
    for key, value in table.items():
        check_type(path, key, value, types[key])
    return table


def check_type(path, key, value, kind):
    """A TOML value of the field's type: true/false for a switch (a string "no" would count as on), an integer
    for an int, a number for a float, a string for a name or a path (an integer path would be a file descriptor),
    a list for a field of several values (dump_step = [N, "DIR"]; the field's own check says what each must be)."""
    ok = {bool: lambda v: isinstance(v, bool),
          int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          str: lambda v: isinstance(v, str),
          list: lambda v: isinstance(v, list)}[kind](value)
    if not ok:
        example = {bool: "true or false", int: "an integer, e.g. 4", float: "a number, e.g. 0.05",
                   str: 'a string in quotes, e.g. "x"', list: 'a list, e.g. [1, "dump"]'}[kind]
        raise ConfigError(f"config file {path!r}: {key} = {value!r} is not {example} (TOML type "
                          f"{type(value).__name__})")
