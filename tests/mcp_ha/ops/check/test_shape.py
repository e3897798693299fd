"""mcp_ha/ops/check/shape.py: a shape file loads into a Shape, or fails with a message naming the file and why."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import ROOT

from mcp_ha.ops.check import Call, Shape, ShapeError, load_shape

pytestmark = pytest.mark.quick


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "ha_shape.py"
    path.write_text(text)
    return path


@pytest.mark.parametrize("name", ["ha_shape.py", "examples/cart/ha_shape.py", "examples/jobs/ha_shape.py"])
def test_the_kits_own_shape_files_load(name: str) -> None:
    shape = load_shape(ROOT / name)
    assert isinstance(shape.write, Call) and isinstance(shape.read, Call)
    assert shape.once_call is (shape.once or shape.write)


def test_a_shape_file_next_to_its_server_imports_from_its_folder(tmp_path: Path) -> None:
    (tmp_path / "tools_of_mine.py").write_text("WRITE = 'add'\n")
    path = write(
        tmp_path,
        "from mcp_ha.ops.check import Call, Shape\nfrom tools_of_mine import WRITE\n"
        "shape = Shape(write=Call(WRITE), read=Call('get'), count=lambda r: r['n'])\n",
    )
    assert load_shape(path).write.tool == "add"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("this is not python(", "SyntaxError"),
        ("raise RuntimeError('no redis here')", "RuntimeError: no redis here"),
        ("shape = 3", "defines no `shape = Shape(...)` (found a int named shape)"),
        ("x = 1", "defines no `shape = Shape(...)` (found nothing named shape)"),
        (
            "from mcp_ha.ops.check import Shape\nshape = Shape(write='inc', read='get', count=len)",
            "Shape.write must be a Call, not str",
        ),
        (
            "from mcp_ha.ops.check import Call, Shape\nshape = Shape(write=Call('a'), read=Call('b'), count=3)",
            "Shape.count must be a function",
        ),
        ("from mcp_ha.ops.check import Call, Shape\nshape = Shape(Call('a'), Call('b'), len)", "TypeError"),
    ],
)
def test_a_bad_shape_file_is_refused_by_name_and_reason(tmp_path: Path, text: str, says: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ShapeError) as raised:
        load_shape(path)
    assert str(raised.value).startswith(f"{path}:") and says in str(raised.value)


def test_a_shape_importing_the_checks_old_place_is_told_the_new_one(tmp_path: Path) -> None:
    path = write(tmp_path, "from mcp_ha.check import Call, Shape\n")
    with pytest.raises(ShapeError, match=r"import from mcp_ha\.ops\.check"):
        load_shape(path)


def test_a_missing_shape_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ShapeError, match="no such file"):
        load_shape(tmp_path / "nowhere.py")


def test_arguments_may_depend_on_the_previous_write() -> None:
    call = Call("job_status", lambda wrote: {"job_id": wrote["job"]["id"] if wrote else None})
    assert call.arguments_after({"job": {"id": "ab"}}) == {"job_id": "ab"}
    assert call.arguments_after(None) == {"job_id": None}
    assert Call("get").arguments_after({"x": 1}) == {}


def test_count_must_be_an_int_and_state_defaults_to_it() -> None:
    shape = Shape(write=Call("inc"), read=Call("get"), count=lambda r: r["n"])
    assert shape.count_of({"n": 4}) == 4 and shape.state_of({"n": 4}) == 4
    with pytest.raises(ShapeError, match="not an int"):
        shape.count_of({"n": "4"})
    with pytest.raises(ShapeError, match="not an int"):
        shape.count_of({"n": True})
    kept = Shape(write=Call("add"), read=Call("view"), count=lambda r: r["n"], state=lambda r: r["orders"])
    assert kept.state_of({"n": 1, "orders": [1]}) == [1]
