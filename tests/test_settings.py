"""The settings are written once: every TrainConfig / ModelConfig field that is a flag is in hsgd.train --help with
its help text and default, hsgd.verify's parser is built from the same fields (the same help texts), and the help
describes the dp x pp x tp grid."""
from argparse import Namespace
from dataclasses import fields

import pytest

from hsgd.model.config import ModelConfig, flag_names
from hsgd.errors import ConfigError
from hsgd.run.config_file import read_toml
from hsgd.run.flags import GROUPS, MODEL_FLAGS, build_parser, configs_from_args
from hsgd.step.settings import TrainConfig


def squashed(text):
    """`text` without any whitespace: argparse re-wraps help texts (and may break lines after a hyphen)."""
    return "".join(text.split())


HELP = {f.name: f.metadata["help"] for _, group in GROUPS for f in fields(group) if "help" in f.metadata}


def options(parser):
    """{dest: argparse action} of every --flag of `parser`."""
    return {a.dest: a for a in parser._actions if a.option_strings and a.dest != "help"}


def test_every_field_is_a_flag_with_its_help_text():
    text = build_parser().format_help()
    flat = squashed(text)
    for title, group in GROUPS:
        assert squashed(title) in flat, title
        for f in fields(group):
            if "help" not in f.metadata:
                continue
            assert f"--{f.name.replace('_', '-')}" in text, f.name
            for line in f.metadata["help"].split("\n"):
                assert squashed(line) in flat, (f.name, line)
    # every TrainConfig field is a flag (a TOML key too), and the model's flags are all but vocab_size
    assert {f.name for f in fields(TrainConfig)} | set(MODEL_FLAGS) == set(HELP)
    assert set(MODEL_FLAGS) == {f.name for f in fields(ModelConfig)} - {"vocab_size"}
    print(f"{len(HELP)} flags in hsgd.train --help, each with its help text")


def test_help_describes_dp_pp_tp_and_the_renamed_flag():
    text = " ".join(build_parser().format_help().split())
    assert "P = dp x pp x cp x tp MPI ranks" in text and "the lecture's G groups" in text and "the lecture's M" in text
    usage_and_flags, epilog = text.split("Example:")
    assert "P = dp x tp" not in text and "--grad-accum" in epilog and "--grad-accum" not in usage_and_flags
    assert "data-parallel size: model replicas, each on its own slice of the batch (ranks / (pp * tp))" in text
    for scheme in ("megatron:", "gather:", "sequence:"):
        assert scheme in text
    groups = {g.title: [a.dest for a in g._group_actions] for g in build_parser()._action_groups}
    experiments = next(v for k, v in groups.items() if k.startswith("experiments"))
    assert {"inject_fault", "straggler"} <= set(experiments)
    assert {"trace", "plot", "log_json"} <= set(groups["output"])


def test_verify_parser_is_built_from_the_same_fields():
    from hsgd import verify
    train_flags, verify_flags = options(build_parser()), options(verify.build_parser())
    assert set(verify.ORACLE_FLAGS) <= set(verify_flags)                  # the tolerance oracle's own
    verify_flags = {k: a for k, a in verify_flags.items() if k not in verify.ORACLE_FLAGS}
    assert set(verify_flags) == set(verify.VERIFY_FLAGS) and set(verify_flags) < set(train_flags)
    for name, action in verify_flags.items():
        if name in verify.VERIFY_DEFAULTS:                     # verify's own default, shown in its help
            first, *rest = HELP[name].split("\n")
            assert action.help == "\n".join([f"{first} ({verify.VERIFY_DEFAULTS[name]})", *rest]), name
            assert action.default == verify.VERIFY_DEFAULTS[name]
        else:
            assert action.help == train_flags[name].help, name
        choices = train_flags[name].choices
        if name == "dtype":                                    # verify's one more: fp8, the oracle of FP8 products
            choices = (*choices, "fp8")
        assert (action.type, action.choices, action.metavar) == \
            (train_flags[name].type, choices, train_flags[name].metavar), name
    assert "P = dp x pp x cp x tp MPI ranks" in " ".join(verify.build_parser().format_help().split())
    print(f"{len(verify_flags)} flags of hsgd.verify, help texts identical to hsgd.train's")


def test_defaults_come_from_the_dataclasses():
    """No flag given: the parser adds nothing, so the run gets the dataclass defaults (and verify its own)."""
    from hsgd import verify
    cfg, tc = configs_from_args(build_parser().parse_args([]), world_size=1)
    assert cfg == ModelConfig() and tc == TrainConfig(tp=1, dp=1) and tc.micro_batches == 1
    args = vars(verify.build_parser().parse_args([]))
    cfg, tc = configs_from_args(Namespace(**{k: v for k, v in args.items() if k not in verify.ORACLE_FLAGS}), 1)
    assert cfg == ModelConfig(seq_len=16, d_model=32, n_layers=2, n_heads=4, d_ff=64)
    assert (tc.dtype, tc.batch_size) == ("float64", 8)


def test_toml_file_fills_the_same_fields_and_names_the_renamed_key(tmp_path):
    good = tmp_path / "run.toml"
    good.write_text('micro_batches = 2\ntp_scheme = "gather"\nd_model = 16\n')
    cfg, tc = configs_from_args(build_parser().parse_args(["--config", str(good), "--batch-size", "4"]), 1)
    assert (tc.micro_batches, tc.tp_scheme, tc.batch_size, cfg.d_model) == (2, "gather", 4, 16)
    old = tmp_path / "old.toml"
    old.write_text("grad_accum = 2\n")
    with pytest.raises(ConfigError, match="grad_accum is now micro_batches"):
        read_toml(str(old))
    with pytest.raises(TypeError):
        TrainConfig(grad_accum=2)


def test_groups_are_plain_dataclasses_read_flat():
    tc = TrainConfig(tp=2, lr=0.1, micro_batches=4, zero=1, inject_fault="1:2")
    assert (tc.tp, tc.lr, tc.micro_batches, tc.zero, tc.inject_fault) == (2, 0.1, 4, 1, "1:2")
    assert flag_names(ModelConfig) == MODEL_FLAGS
    with pytest.raises(ConfigError, match="micro_batches=0 must be a positive integer"):
        TrainConfig(micro_batches=0).validate()
    TrainConfig(pp=2, tp_scheme="sequence").validate()                 # sequence runs with pipelines too


@pytest.mark.parametrize("flags, world, words", [
    (["--cp", "8", "--seq-len", "8"], 8, "seq_len=8 does not cut into 2*cp = 16 equal chunks"),
    (["--cp", "4", "--seq-len", "12"], 8, "use seq_len a multiple of 8 (e.g. [8, 16, 24]) or cp in [2, 3, 6]"),
    (["--cp", "2", "--tp", "4", "--tp-scheme", "sequence", "--seq-len", "4"], 8, "use seq_len a multiple of 8"),
    (["--cp", "3"], 8, "dp*pp*cp*tp = 2*1*3*1 = 6 does not match the 8 ranks"),
    (["--cp", "0"], 8, "cp=0 must be a positive integer"),
])
def test_context_parallel_sizes_that_do_not_split_are_refused_with_what_works(flags, world, words):
    from hsgd.errors import UsageError                        # ConfigError, or GridError for the world size
    with pytest.raises(UsageError) as e:
        configs_from_args(build_parser().parse_args(flags), world_size=world)
    print(e.value)
    assert words in str(e.value)


def test_a_sequence_scheme_shard_may_cross_the_chunks():
    """--tp-scheme sequence with cp: a rank's T/cp positions split into tp T-shards; only T % lcm(2cp, cp tp) = 0
    is needed (T = 8, cp = 2, tp = 4: chunks of 2, T-shards of 1)."""
    cfg, tc = configs_from_args(build_parser().parse_args(["--cp", "2", "--tp", "4", "--tp-scheme", "sequence",
                                                           "--seq-len", "8"]), world_size=8)
    assert (tc.dp, tc.cp, tc.tp, cfg.seq_len) == (1, 2, 4, 8)


@pytest.mark.parametrize("flags, words", [
    (["--dtype", "bfloat16", "--reduce-dtype", "bfloat16", "--zero", "2"], "--zero 2 and 3 reduce-scatter during"),
    (["--reduce-dtype", "bfloat16"], "reduce_dtype='bfloat16' needs --dtype bfloat16 or float16"),
    (["--dtype", "bfloat8"], "argument --dtype: invalid choice: 'bfloat8'"),
])
def test_what_the_narrow_formats_do_not_combine_with_is_refused(flags, words):
    from hsgd.errors import UsageError
    with pytest.raises(UsageError) as e:
        configs_from_args(build_parser().parse_args(flags), world_size=1)
    print(e.value)
    assert words in str(e.value)


@pytest.mark.parametrize("flags,words", [
    (["--dtype", "float64", "--layouts", "1x1x1"], "--layouts, --seeds, --loss-steps, --resume-after and --plot are"),
    (["--dtype", "bfloat16", "--layouts", "1x1"], "'1x1' is not a layout; write dp x pp x tp"),
    (["--dtype", "bfloat16", "--layouts", "1x1x1,2x1x1"], "2x1x1 needs 2 ranks, mpirun started 1"),
    (["--dtype", "float16", "--seeds", "0"], "give --seeds from 1 to 64"),
    (["--dtype", "float64", "--seeds", "3"], "--resume-after and --plot are the tolerance oracle's"),
    (["--dtype", "float64", "--resume-after", "2"], "--resume-after and --plot are the tolerance oracle's"),
    (["--dtype", "fp8", "--loss-steps", "2", "--resume-after", "1"], "--loss-steps compares a loss, --resume-after"),
    (["--dtype", "fp8", "--fp8-recipe", "delayed"], "use --loss-steps K (K >= 2), --resume-after K (K >= 1)"),
    (["--dtype", "bfloat16", "--layouts", "1x1x1,1x1x1x1"], "1x1x1x1 is given twice"),
    (["--dtype", "bfloat16", "--plot", "/nonexistent-folder/o.png"], "its folder '/nonexistent-folder' does not exist"),
    (["--dtype", "bfloat16", "--pp-split", "1,1"], "pp_split")])
def test_verify_refuses_what_the_oracle_cannot_do(flags, words, capsys):
    from hsgd import verify
    assert verify.main(flags) == 2
    err = capsys.readouterr().err
    print(err)
    assert words in err and err.count("hsgd: error:") == 1


def test_the_oracle_on_one_rank_passes_and_draws(tmp_path, capsys):
    """hsgd.verify --dtype bfloat16 in one process: the layout 1x1x1 against float64, inside its band; --plot."""
    from hsgd import verify
    assert verify.main(["--dtype", "bfloat16", "--seeds", "2", "--plot", str(tmp_path / "o.png")]) == 0
    out = capsys.readouterr().out
    print(out[-600:])
    assert "PASS: every difference of 1x1x1 is inside its band" in out and (tmp_path / "o.png").stat().st_size > 0


@pytest.mark.parametrize("flags, words", [
    (["--moe-experts", "8", "--ep", "3"], "--ep 3 does not divide dp x cp = 4 x 1 = 4"),
    (["--moe-experts", "6", "--ep", "4"], "--moe-experts 6 cannot be split over --ep 4 ranks; use ep in [1, 2]"),
    (["--moe-experts", "4", "--moe-top-k", "5"], "moe_top_k=5 is above moe_experts=4"),
    (["--moe-experts", "4", "--moe-capacity-factor", "0"], "moe_capacity_factor=0.0 must be a number above 0"),
    (["--moe-experts", "4", "--moe-capacity-factor", "-1.5"], "moe_capacity_factor=-1.5 must be a number above 0"),
    (["--moe-experts", "4", "--moe-balance-domain", "global", "--micro-batches", "2"],
     "--moe-balance-domain global needs the whole batch's expert counts before any backward pass"),
    (["--moe-experts", "4", "--moe-balance-layers", "pooled", "--pp", "2", "--n-layers", "2"],
     "--moe-balance-layers pooled counts over every MoE block at once"),
    (["--ep", "2"], "--ep 2 splits experts, but the model has none"),
    (["--moe-experts", "4", "--ep", "2", "--hierarchical", "--ranks-per-node", "1"],
     "--ep 2 with --hierarchical --ranks-per-node 1: the experts' ranks"),
    (["--moe-experts", "4", "--moe-balance-domain", "tokens"], "invalid choice: 'tokens'"),
])
def test_expert_settings_a_layout_cannot_train_are_refused_in_one_line(flags, words, capsys):
    """Each refusal is one line that says what is wrong and what would work (exit 2 through hsgd.cli)."""
    from hsgd.errors import UsageError
    with pytest.raises((UsageError, SystemExit)) as e:
        configs_from_args(build_parser().parse_args(flags + ["--tp", "2"]), world_size=8)
    message = str(e.value) if e.type is not SystemExit else capsys.readouterr().err
    print(message.strip())
    assert words in message and len(message.strip().splitlines()) <= 2


def test_the_oracle_refuses_experts_it_would_count_unlike_the_layouts():
    """One one-rank reference for every layout: a capacity or the micro-batch balance domain would be counted
    differently by each layout, so the oracle says so in one line (hsgd.verify in float64 counts as the layout)."""
    from mpi4py import MPI
    from hsgd.check.oracle import oracle
    from hsgd.errors import ConfigError
    from hsgd.step.settings import TrainConfig
    cfg = ModelConfig(moe_experts=4, moe_capacity_factor=1.25)
    with pytest.raises(ConfigError, match="counts each layout's tokens its own way") as e:
        oracle(cfg, TrainConfig(dtype="bfloat16"), [(1, 1, 1, 1)], 1, MPI.COMM_SELF, None)
    print(e.value)
