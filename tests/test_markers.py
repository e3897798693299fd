"""The tiers' markers: conftest's hook marks each test by what its fixtures start, and `quick` is exactly the
tests that start nothing. Run on a suite of stand-ins by pytest in this process (pytester), starting nothing."""

from __future__ import annotations

import pytest
from conftest import LONG, ROOT, SERIAL

pytest_plugins = ["pytester"]

# The kit's conftest, loaded under another name beside the stand-ins: its hook, `starts` and its guard.
CONFTEST = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("kit_conftest", {str(ROOT / "tests" / "conftest.py")!r})
kit = importlib.util.module_from_spec(spec)
sys.modules["kit_conftest"] = kit
spec.loader.exec_module(kit)
pytest_collection_modifyitems = kit.pytest_collection_modifyitems
_quick_starts_no_process = kit._quick_starts_no_process
"""

STAND_INS = """
import subprocess
import pytest
from kit_conftest import starts

@pytest.fixture(scope="session")
@starts("redis")
def a_redis():
    return "redis"

@pytest.fixture
def a_client(a_redis):
    return a_redis

def test_through_a_fixture_that_uses_it(a_client):
    pass

def test_plain():
    pass

@pytest.mark.haproxy
def test_marked_by_hand():
    pass
"""


def test_each_test_is_marked_by_what_it_starts_and_a_quick_one_may_start_nothing(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST)
    sneaky = "\ndef test_sneaky():\n    subprocess.run(['true'])\n"
    pytester.makepyfile(test_stand_ins=STAND_INS + sneaky)
    run = pytester.inline_run("-q", "-p", "no:cacheprovider")
    items = run.getcalls("pytest_collection_finish")[0].session.items
    marks = {i.name: sorted(m.name for m in i.iter_markers()) for i in items}
    assert marks == {
        "test_through_a_fixture_that_uses_it": ["redis"],
        "test_plain": ["quick"],
        "test_marked_by_hand": ["haproxy"],
        "test_sneaky": ["quick"],
    }
    # The derived tier holds at run time too: a quick test starting a process in its body fails, naming it.
    (failed,) = run.listoutcomes()[2]
    assert failed.nodeid.endswith("test_sneaky")
    assert "test_sneaky is quick but starts ['true']: mark it by what it starts" in str(failed.longrepr)


def test_a_test_marked_quick_by_hand_that_starts_a_process_is_an_error(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_stand_ins=STAND_INS + "\n@pytest.mark.quick\ndef test_wrong(a_client):\n    pass\n")
    result = pytester.runpytest_inprocess("--collect-only", "-q", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*test_wrong: marked quick but starts redis*"])


def test_every_long_and_serial_entry_names_a_test_file_of_the_suite() -> None:
    """A file moved or renamed would leave its entry matching nothing: the long test back in the default tier,
    the timing one on a parallel worker."""
    for entry in (*LONG, *SERIAL):
        assert (ROOT / entry.split("::")[0]).is_file(), entry
