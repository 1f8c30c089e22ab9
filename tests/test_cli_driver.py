"""tests/cli_driver.py, which runs many cases of an entry point in one process, reports what
separate processes would: exit codes, tracebacks, output written to the file descriptors, and no
flag value, nor a prelude's patch, carried from one case to the next."""

from conftest import cli_case

PATCHED = {
    "args": ["--mode=word"],
    "prelude": "from tests import fake_cli\npatch(fake_cli, 'WORD', extra['word'])",
}
PATCHED["extra"] = {"word": "patched"}
CASES = [["--mode=crash"], ["--mode=fd"], ["--mode=bad"], ["--count=7", "--mode=count"], ["--mode=count"]]
CASES += [PATCHED, ["--mode=word"]]


def run(*args):
    """The result of the case args (arguments, or one case with a prelude)."""
    case = args[0] if args and isinstance(args[0], dict) else list(args)
    return cli_case("tests.fake_cli", CASES, case)


def test_a_crash_is_a_traceback_and_a_nonzero_exit():
    result = run("--mode=crash")
    assert result.returncode == 1 and "Traceback" in result.stderr and "RuntimeError: boom" in result.stderr


def test_what_is_written_to_the_file_descriptor_is_captured():
    assert run("--mode=fd").stderr == "written to fd 2\n"


def test_bad_input_is_one_line_and_exit_2():
    result = run("--mode=bad")
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "fake_cli.py: error: --mode: bad"
    ]


def test_flags_return_to_their_defaults_between_cases():
    assert run("--count=7", "--mode=count").stdout == "count=7\n"
    assert run("--mode=count").stdout == "count=0\n"


def test_a_preludes_patch_holds_for_its_case_only():
    assert run(PATCHED).stdout == "patched\n"
    assert run("--mode=word").stdout == "plain\n"
