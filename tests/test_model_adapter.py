"""`ModelAdapter` declares everything the package asks of an adapter; each family overrides what it must."""

from __future__ import annotations

import ast
import inspect
import pathlib
import re
import textwrap

import hf_raincheck.models  # noqa: F401  (registers every family's adapter class)
from hf_raincheck.models import ModelAdapter

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "hf_raincheck"


def _adapter_attributes_used() -> set[str]:
    """Names read on an adapter (``adapter.x``, ``state.adapter.x``, ``self.adapter.x``) outside models/."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        if path.is_relative_to(PACKAGE / "models"):
            continue
        names.update(re.findall(r"\badapter\.([A-Za-z_]\w*)", path.read_text()))
    return names


def _must_override(name: str) -> bool:
    """Whether ModelAdapter's `name` does nothing but raise NotImplementedError (after its docstring)."""
    member = vars(ModelAdapter)[name]
    function = member.fget if isinstance(member, property) else member
    if not inspect.isfunction(function):
        return False
    body = ast.parse(textwrap.dedent(inspect.getsource(function))).body[0].body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return len(body) == 1 and isinstance(body[0], ast.Raise) and "NotImplementedError" in ast.unparse(body[0])


def _families() -> list[type]:
    found, todo = [], list(ModelAdapter.__subclasses__())
    while todo:
        cls = todo.pop()
        if cls.__module__.startswith("hf_raincheck."):  # not a test's own subclass
            found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


def test_model_adapter_declares_every_attribute_the_package_uses():
    used = _adapter_attributes_used()
    assert {"special_token_ids", "span_grids", "language_forward", "gdn_glue", "embed_tokens"} <= used
    assert sorted(name for name in used if not hasattr(ModelAdapter, name)) == []


def test_every_declaration_has_a_docstring():
    for name, member in vars(ModelAdapter).items():
        function = member.fget if isinstance(member, property) else member
        if inspect.isfunction(function) and not name.startswith("_"):
            assert function.__doc__, f"ModelAdapter.{name} has no docstring"


def test_every_family_overrides_what_it_must():
    required = [name for name in vars(ModelAdapter) if _must_override(name)]
    assert {"image_token_id", "special_token_ids", "span_grids", "lm_head", "vision_features"} <= set(required)
    families = _families()
    assert len(families) >= 3
    for cls in families:
        missing = [name for name in required if getattr(cls, name) is getattr(ModelAdapter, name)]
        assert missing == [], f"{cls.__name__} does not define {missing}"


def test_the_base_adapter_says_what_a_family_must_define():
    class Bare(ModelAdapter):
        pass

    adapter = Bare(model=None)
    calls = (lambda: adapter.image_token_id, adapter.special_token_ids, lambda: adapter.span_grids([], None, None, []))
    for call in calls:
        try:
            call()
        except NotImplementedError as error:
            assert "Bare must define" in str(error)
        else:  # pragma: no cover
            raise AssertionError("the base adapter answered for a family")
