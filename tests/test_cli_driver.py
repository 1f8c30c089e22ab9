"""tests/cli_driver.py, which runs many refusal cases of an entry point in one process, reports
what separate processes would: exit codes, tracebacks, output written to the file descriptors,
and no flag value carried from one case to the next."""

from conftest import cli_case

CASES = [["--mode=crash"], ["--mode=fd"], ["--mode=bad"], ["--count=7", "--mode=count"], ["--mode=count"]]


def run(*args):
    return cli_case("tests.fake_cli", CASES, list(args))


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
