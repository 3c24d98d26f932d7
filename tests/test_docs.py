"""The documentation site: it builds with --strict, every command block of the tutorials and how-to guides is run
here (``<!-- doc: run -->``), run by the test it names (``<!-- doc: tested-by PATH -->``) or marked
``<!-- doc: illustrative (why) -->``, and every fedpar line in any block parses as the CLI parses it."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from fedpar.cli.main import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
GUIDES = sorted([*(DOCS / "tutorials").glob("*.md"), *(DOCS / "how-to").glob("*.md")])
COMMAND_LANGUAGES = {"bash", "sh", "shell", "console", ""}
TAG = re.compile(r"<!-- doc: (run|tested-by|illustrative)\b(.*?)-->")
FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```", re.M | re.S)


def blocks(page: Path) -> list[tuple[str, str, str, str]]:
    """(language, body, tag, tag's words) of each fenced block of ``page``; tag is '' when the line above has none."""
    text = page.read_text()
    out = []
    for match in FENCE.finditer(text):
        above = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        tag = TAG.fullmatch(above.strip())
        out.append((match.group(1), match.group(2), tag.group(1) if tag else "", tag.group(2).strip() if tag else ""))
    return out


def command_lines(body: str) -> list[str]:
    """The commands of a block: continuation lines joined, comments and console output dropped."""
    joined = body.replace("\\\n", " ")
    lines = []
    for line in joined.splitlines():
        line = line.strip()
        if line.startswith("$ "):
            line = line[2:]
        elif body.lstrip().startswith("$ "):
            continue  # a console block's output
        if line and not line.startswith("#"):
            lines.append(line)
    return lines


@pytest.fixture(scope="module")
def built_site(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The site built by `mkdocs build --strict` once for this file's tests (they only read it): its folder and
    the build's outcome."""
    pytest.importorskip("mkdocs")  # the docs extra (make test installs it; the GPU box has not)
    site = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    return site, done


def test_the_site_builds_strict(built_site):
    """`mkdocs build --strict` (what `make docs` runs): a broken link, nav entry or API reference fails it."""
    site, out = built_site
    assert out.returncode == 0, out.stderr[-4000:]
    assert "WARNING" not in out.stderr, out.stderr[-4000:]
    for name in ("serve", "client", "simulate", "train", "certs", "export", "simulate-workers"):
        assert (site / "reference" / "cli" / name / "index.html").exists()
    # A list right under a paragraph's line (no blank line between) is, to MkDocs, more of that paragraph: its
    # items showed as one run-on text with '- ' in it (QA: 16 lists on 6 pages)
    run_on = [f"{page.relative_to(site)}: {paragraph[:80]!r}"
              for page in site.rglob("*.html")
              for paragraph in re.findall(r"<p>((?:(?!</p>).)*)</p>", page.read_text(), re.S)
              if re.search(r"\n(?:- |\d+\. )", paragraph)]
    assert not run_on, "put a blank line above these lists:\n" + "\n".join(run_on)


@pytest.mark.parametrize("page", GUIDES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_command_block_is_run_tested_or_illustrative(page):
    for language, body, tag, words in blocks(page):
        if language not in COMMAND_LANGUAGES:
            continue
        assert tag, f"{page.relative_to(ROOT)}: a command block has no <!-- doc: ... --> tag:\n{body}"
        if tag == "tested-by":
            assert (ROOT / words.split()[0]).exists(), f"{page.relative_to(ROOT)}: no test {words}"
        if tag == "illustrative":
            assert words.startswith("("), f"{page.relative_to(ROOT)}: say why a block is illustrative:\n{body}"
        for line in command_lines(body):  # make's .venv is not on PATH: a bare torchrun was 'command not found'
            assert line.split()[0] not in ("torchrun", "python"), \
                f"{page.relative_to(ROOT)}: name the venv's program (.venv/bin/{line.split()[0]}): {line}"


def _parses(argv: list[str]) -> None:
    parser = build_parser(only=argv[0])
    parser.parse_args(argv)


@pytest.mark.parametrize("page", [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_every_fedpar_line_in_the_docs_parses(page, capsys):
    """A renamed or removed option breaks the page's lines even where they are illustrative."""
    for language, body, tag, _ in blocks(page):
        if language not in COMMAND_LANGUAGES or body.lstrip().startswith("$ "):
            continue  # console blocks show failures on purpose (run below)
        for line in command_lines(body):
            words = shlex.split(line, comments=True)
            if not words or Path(words[0]).name != "fedpar" or "..." in words:
                continue
            try:
                _parses(words[1:])
            except SystemExit as exc:
                pytest.fail(f"{page.relative_to(ROOT)}: {line}\n{capsys.readouterr().err} (exit {exc.code})")


def _sandbox(tmp_path: Path) -> Path:
    """A folder laid out as the repository root for a doc's commands: .venv/bin/fedpar runs this fedpar, and
    examples/ is the repository's."""
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    shim = bin_dir / "fedpar"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m fedpar.cli.main "$@"\n')
    shim.chmod(0o755)
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    return tmp_path


RUN_PAGES = [p for p in GUIDES if any(tag == "run" for _, _, tag, _ in blocks(p))]


def _run(command: str, cwd: Path, capsys) -> tuple[int, str]:
    """Run one command line of a doc in ``cwd``: a fedpar line in this process (as the ``fedpar`` script would, less
    the interpreter's start-up), anything else in a shell; returns its exit code and its stdout and stderr."""
    words = shlex.split(command, comments=True)
    if Path(words[0]).name == "fedpar":
        capsys.readouterr()
        try:
            code = main(words[1:])
        except SystemExit as exc:  # argparse's refusal of an option
            code = exc.code
        out = capsys.readouterr()
        return code, out.out + out.err
    done = subprocess.run(command, shell=True, cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    return done.returncode, done.stdout + done.stderr


@pytest.mark.parametrize("page", RUN_PAGES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_the_run_blocks_run_as_written(page, tmp_path, monkeypatch, capsys):
    """Each `doc: run` block, line by line, in one folder per page (a later block may use an earlier one's output).
    A console block's commands must fail with the line shown under them, and no traceback."""
    monkeypatch.chdir(_sandbox(tmp_path))
    for _, body, tag, _ in blocks(page):
        if tag != "run":
            continue
        if body.lstrip().startswith("$ "):
            for command, expected in re.findall(r"^\$ (.*)\n((?:(?!\$ ).*\n?)*)", body, re.M):
                code, output = _run(command, tmp_path, capsys)
                assert code not in (0, None), (command, output[-2000:])
                for line in expected.strip().splitlines():
                    assert line.strip() in output, (command, line, output[-2000:])
                assert "Traceback" not in output, output
            continue
        for command in command_lines(body):
            code, output = _run(command, tmp_path, capsys)
            assert code in (0, None) and "Traceback" not in output, (command, output[-3000:])


def test_the_cli_reference_pages_hold_every_option_of_every_subcommand_in_its_help_group():
    """The reference is generated from the parsers (docs/hooks/cli_reference.py): each option appears once, under
    the title of the --help group it belongs to."""
    pytest.importorskip("mkdocs")
    import argparse
    import importlib.util

    from fedpar.cli.main import subcommand_parser
    from fedpar.cli.subcommands import SUBCOMMANDS

    spec = importlib.util.spec_from_file_location("cli_reference", DOCS / "hooks" / "cli_reference.py")
    reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reference)
    for name in SUBCOMMANDS:
        page = reference.command_page(name)
        parser = subcommand_parser(build_parser(only=name), name)
        for group in parser._action_groups:
            for action in group._group_actions:
                if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
                    continue
                flag = action.option_strings[0] if action.option_strings else action.dest
                section = page.split(f"## {group.title}\n", 1)[1].split("\n## ", 1)[0]
                assert f"`{flag}`" in section, (name, group.title, flag)


def test_the_pages_list_the_strategies_the_registry_has():
    """The lists of strategies in the prose are generated (docs/hooks/strategy_lists.py): a page that names the
    linear strategies asks for the list, and the list is the registry's."""
    import importlib.util

    from fedpar.aggregation.compatibility import linear_strategy_names

    spec = importlib.util.spec_from_file_location("strategy_lists", DOCS / "hooks" / "strategy_lists.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    for page in ("how-to/secure-aggregation.md", "how-to/aggregator-ranks.md", "explanation/composition.md"):
        assert "<!-- linear strategies -->" in (DOCS / page).read_text(), f"{page}: list the linear strategies with " \
            "<!-- linear strategies --> (docs/hooks/strategy_lists.py fills it in), not by hand"
    page = hook.on_page_markdown("sums: <!-- linear strategies -->.", None, None, None)
    assert page == f"sums: {', '.join(linear_strategy_names())}."


@pytest.fixture(scope="module")
def api_page(built_site) -> str:
    """The built Python API page's HTML."""
    site, out = built_site
    assert out.returncode == 0, out.stderr[-4000:]
    return (site / "reference" / "python-api" / "index.html").read_text()


def test_the_api_page_shows_no_sphinx_role(api_page):
    """The docstrings' Sphinx roles (:class:`ClientData`) are rendered as cross-references or code
    (docs/hooks/sphinx_roles.py), not shown as text."""
    roles = re.findall(r":(?:py:)?(?:class|func|meth|attr|mod|exc|data|obj):\S{0,40}", api_page)
    assert not roles, roles
    assert 'href="#aggregation.privacy.DPStrategy"' in api_page  # build_strategy's :class:`DPStrategy`: a link


def test_every_registered_strategy_is_on_the_api_page_with_its_options(api_page):
    """The page's strategy entries come from the registry (docs/hooks/strategy_lists.py): a strategy added by
    docs/contributing.md's recipe appears with no edit of the page, with its constructor's options."""
    from fedpar.aggregation.catalog import strategy_classes
    from fedpar.aggregation.options import option_specs

    assert "aggregation.robust.Krum" not in (DOCS / "reference" / "python-api.md").read_text()  # not by hand
    for name, cls in strategy_classes().items():
        identifier = f"{cls.__module__.removeprefix('fedpar.')}.{cls.__qualname__}"
        assert f'id="{identifier}"' in api_page, (name, identifier)
        before = api_page.split(f'id="{identifier}"', 1)[0]
        line = before[before.rfind("<p>"):]  # the paragraph above the entry: its --strategy name and options
        assert f"--strategy {name}" in line, (name, line)
        for option in option_specs(cls):
            assert f"<code>{option}</code>" in line, (name, option, line)
    fedavgm = api_page.split('id="aggregation.fedavg_strategies.FedAvgM"', 1)[1].split("doc-contents", 1)[0]
    assert "server_learning_rate" in fedavgm and "server_momentum" in fedavgm  # the constructor's signature


def test_the_api_page_documents_what_a_program_embedding_fedpar_calls(api_page):
    """What the tutorial's "In Python, without the CLI" and examples/in_python.py use has an entry."""
    for identifier in ("server.assembly.CoordinatorAssembly", "server.assembly.CoordinatorAssembly.for_task",
                       "server.assembly.CoordinatorAssembly.server", "server.app.CoordinatorServer.start",
                       "server.app.CoordinatorServer.wait", "server.app.CoordinatorServer.stop",
                       "server.config.CoordinatorConfig", "client.agent.Agent", "client.runtime.ClientRuntime.run",
                       "client.links.AgentConfig", "client.task_trainer.TaskTrainer", "tasks.reference.load_task",
                       "tasks.data.share_of"):
        assert f'id="{identifier}"' in api_page, identifier


def test_a_quick_benchmark_run_leaves_the_published_figures_alone(tmp_path):
    """The benchmarks page is built from benchmarks/results/*.json: a --quick smoke run writes under runs/ instead."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_results", ROOT / "benchmarks" / "results.py")
    results = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(results)
    published = results.RESULTS / "round_bench.json"
    assert results.destination(published, ["round_bench.py", "--quick"]) == results.SMOKE / "round_bench.json"
    assert results.destination(published, ["round_bench.py"]) == published
    assert results.destination(tmp_path / "r.json", ["round_bench.py", "--quick"]) == tmp_path / "r.json"
    assert results.SMOKE.is_relative_to(ROOT / "runs") and "runs/" in (ROOT / ".gitignore").read_text().split()
    written = results.write_results(tmp_path / "r.json", [], {}, argv=["round_bench.py", "--quick"])
    assert written == tmp_path / "r.json" and written.exists()


def test_every_benchmark_refuses_a_wrong_flag_in_one_line():
    """Each benchmark's parser is the CLI's FedparParser: a mistyped flag is one line, not argparse's whole usage."""
    scripts = [path for path in sorted((ROOT / "benchmarks").glob("*.py")) if "add_argument(" in path.read_text()]
    assert scripts
    for path in scripts:
        text = path.read_text()
        assert "argparse.ArgumentParser(" not in text and "FedparParser(" in text, path.name


def test_no_benchmark_main_hides_a_function_of_its_module_behind_a_local():
    """A local of ``main`` named as one of its module's functions makes every call of that function in ``main`` an
    UnboundLocalError (population_bench.py's default run died so, its --batching branch naming a string ``cell``)."""
    import symtable

    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        module = symtable.symtable(path.read_text(), str(path), "exec")
        functions = {table.get_name(): table for table in module.get_children() if table.get_type() == "function"}
        if "main" in functions:
            hidden = [s.get_name() for s in functions["main"].get_symbols()
                      if s.get_name() in functions and s.is_local()]
            assert not hidden, f"{path.name}: main's locals hide its module's functions {hidden}"


def test_contributing_names_the_benchmarks_that_have_a_quick_run():
    """docs/contributing.md lists the benchmarks that take --quick: the list is the scripts that declare it."""
    page = (DOCS / "contributing.md").read_text().split("## Benchmarks", 1)[1]
    listed = set(re.findall(r"`(\w+)`", page.split("where a script has it (", 1)[1].split(")", 1)[0]))
    scripts = (ROOT / "benchmarks").glob("*.py")
    declared = {path.stem for path in scripts if 'add_argument("--quick"' in path.read_text()}
    assert listed == declared


def test_service_floors_untrained_way_is_a_simulate_command_line_that_is_taken():
    """benchmarks/service_floor.py's untrained way names a --task: simulate refuses --dataset and --model beside it."""
    import importlib.util

    from fedpar.cli.config import given_settings
    from fedpar.cli.main import subcommand_parser
    from fedpar.cli.task_options import check_nothing_replaced

    spec = importlib.util.spec_from_file_location("service_floor", ROOT / "benchmarks" / "service_floor.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    job, ways = bench.simulate_ways(100, 10, 5)
    assert ways["default"] == job
    for flags in ways.values():
        parser = build_parser(only="simulate")
        args = parser.parse_args(["simulate", *flags])
        args._given = given_settings(subcommand_parser(parser, "simulate"), flags, frozenset())  # as main() does
        check_nothing_replaced(args)


def test_the_readmes_run_file_is_one_a_service_takes():
    """The README's deployed block submits examples/run.toml: it exists and reads as a run file (QA: it named a
    run.toml that no page or folder held)."""
    from fedpar.cli.run_settings import read_run_file

    assert "run submit examples/run.toml" in (ROOT / "README.md").read_text()
    assert read_run_file(ROOT / "examples" / "run.toml")["rounds"] == 5


def test_the_readmes_set_up_commands_run_what_it_says():
    """The README's two set-up commands: `make simulate` runs the very command the README quotes (which the first
    simulation's run block runs with 3 rounds), `make test` is what .ci/run calls, the targets the pages name exist,
    and the one-shot serve the README names parses."""
    readme = (ROOT / "README.md").read_text()
    makefile = (ROOT / "Makefile").read_text()
    quoted = re.search(r"`make simulate` runs `(fedpar simulate [^`]+)`", readme).group(1)
    recipe = re.search(r"^simulate:.*\n\t(.+)$", makefile, re.M).group(1)
    assert recipe == f"$(VENV)/bin/{quoted}", (recipe, quoted)
    tutorial = [line for _, body, tag, _ in blocks(DOCS / "tutorials" / "first-simulation.md") if tag == "run"
                for line in command_lines(body) if " simulate " in line]
    assert tutorial == [f".venv/bin/{quoted}".replace("--rounds 10", "--rounds 3")], (tutorial, quoted)
    for target in ("venv", "simulate", "test", "docs"):
        assert re.search(rf"^{target}:", makefile, re.M), f"README or first-simulation.md names make {target}"
    assert re.search(r"^TORCH \?=", makefile, re.M)  # make test TORCH=torch
    assert (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1] == "make test"
    one_shot = re.search(r"The one-shot form, one run and exit, is `fedpar (serve [^`]+)`", readme).group(1)
    _parses(shlex.split(one_shot))


def test_the_api_pages_signatures_are_laid_out_a_parameter_a_line(api_page):
    """mkdocstrings formats the signatures with black (the docs extra): AgentConfig's 19 parameters were one line of
    610 characters."""
    pytest.importorskip("black")
    signature = api_page.split('id="client.links.AgentConfig"', 1)[1].split("doc-signature", 1)[1].split("</pre>")[0]
    assert signature.count("\n") >= 19, signature


def test_the_first_simulations_quoted_table_is_the_table_simulate_prints():
    """first-simulation.md quotes simulate's round table: its lines are what the table prints for those rows (the
    header, the widths, the number formats and the time left), so a changed column shows here."""
    import io

    from fedpar.cli.progress import RoundTable

    quoted = next(body for _, body, tag, words in blocks(DOCS / "tutorials" / "first-simulation.md")
                  if tag == "illustrative" and words.startswith("(output)") and body.startswith("round"))
    header, *rows = quoted.rstrip("\n").splitlines()
    printed = io.StringIO()
    table = RoundTable(len(rows), stream=printed)
    names = ("round", "status", "sampled", "reported", "late", "train_loss", "test_accuracy", "upload_bytes",
             "round_seconds")
    for row in rows:
        cells = dict(zip(names, row.split()))
        numbers = {name: value.replace(",", "") for name, value in cells.items()}
        table.row({**{name: float(value) for name, value in numbers.items() if "." in value},
                   **{name: int(value) for name, value in numbers.items() if value.isdigit()},
                   "round": int(cells["round"].split("/")[0]), "status": cells["status"]})
    assert [line.rstrip() for line in printed.getvalue().splitlines()] == [header, *(row.rstrip() for row in rows)]
