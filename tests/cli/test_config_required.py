"""A required option can come from a --config file (QA: `[client] agent_id = "a"` with `fedpar client --config FILE`
was refused with 'the following arguments are required: --agent-id': argparse checks a required flag, never the
default the file had set); one missing from both is named in one line with the key that could give it."""

from __future__ import annotations


from support.in_process import run_main
from support.ports import free_port



def test_a_config_file_gives_the_client_its_agent_id(tmp_path, capfd):
    (tmp_path / "cl.toml").write_text('[client]\nagent_id = "from-file"\ngive_up_after = 0.3\n')
    done = run_main(["client", "--config", str(tmp_path / "cl.toml"), "--insecure", "--server",
                     f"127.0.0.1:{free_port()}"], capfd)
    assert done.returncode == 1, done.stderr  # parsed, and ran until the closed port was given up on
    assert "fedpar client: from-file: coordinator at 127.0.0.1:" in done.stderr and "Traceback" not in done.stderr


def test_a_config_file_gives_certs_its_out_folder(tmp_path, capfd):
    (tmp_path / "certs.toml").write_text('[certs]\nout = "made"\nagents = "a"\n')
    done = run_main(["certs", "--config", "certs.toml"], capfd, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "made").iterdir()) == ["a.key", "a.pem", "ca.key", "ca.pem",
                                                                       "server.key", "server.pem"]


def test_a_required_option_missing_from_flags_and_file_is_named_with_its_key(tmp_path, capfd):
    (tmp_path / "cl.toml").write_text("[client]\npoll_seconds = 2\n")
    for argv in (["client", "--config", str(tmp_path / "cl.toml"), "--insecure"], ["client", "--insecure"]):
        done = run_main(argv, capfd)
        assert done.returncode == 2
        assert done.stderr.strip() == ("fedpar client: error: the following arguments are required: --agent-id (or "
                                       "agent_id in a --config file's [client] table); see 'fedpar client --help'")
