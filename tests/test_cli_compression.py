"""--compression, --topk-ratio and --int8-block on `fedpar serve` and `fedpar simulate`."""

import pytest


from fedpar.aggregation.compression import CompressionConfig
from fedpar.cli.compression_options import compression_from_args
from fedpar.cli.config import apply_config_defaults
from fedpar.cli.main import build_parser, main


def _parse(argv):
    parser = build_parser()
    apply_config_defaults(parser._subparsers._group_actions[0].choices[argv[0]], argv[1:], argv[0])
    return parser.parse_args(argv)


def test_flags_and_config_files_select_the_compression(tmp_path):
    assert compression_from_args(_parse(["serve"])) == CompressionConfig()
    args = _parse(["serve", "--compression", "int8", "--int8-block", "64"])
    assert compression_from_args(args) == CompressionConfig("int8", int8_block=64)
    toml = tmp_path / "run.toml"
    toml.write_text('[simulate]\ncompression = "topk"\ntopk-ratio = 0.05\n')
    args = _parse(["simulate", "--config", str(toml)])
    assert (args.compression, args.topk_ratio) == ("topk", 0.05)


def test_bad_settings_are_refused_with_a_clear_message(capsys):
    with pytest.raises(SystemExit, match="2"):  # range-checked at parse time (cli/argtypes.py)
        main(["serve", "--port", "0", "--insecure", "--compression", "topk", "--topk-ratio", "2"])
    assert "--topk-ratio: 2 is out of range: it must be in (0, 1]" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="2"):
        main(["simulate", "--compression", "int8", "--int8-block", "0", "--quiet"])
    assert "--int8-block: 0 is out of range" in capsys.readouterr().err


@pytest.mark.parametrize("knob, method", [(["--topk-ratio", "0.5"], "topk"), (["--int8-block", "64"], "int8")])
def test_a_knob_of_a_compression_not_chosen_is_one_line_and_no_run(knob, method, capsys):
    """A user who sets --topk-ratio believes top-k runs: without --compression topk it would not (it was ignored)."""
    assert main(["simulate", *knob, "--rounds", "1", "--quiet"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert lines == [f"fedpar simulate: {knob[0]} applies only with --compression {method}; add it (or drop the "
                     "option)"]
