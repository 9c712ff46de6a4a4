"""The public API is documented: every name ``phalanx`` exports, and what its classes define.

Issue 25 asks for every public name to be documented with Args/Returns/Example, as Lightning
Fabric's API is. This keeps it so: a name without an example, or a public method or property
without a docstring, fails here.
"""

from __future__ import annotations

import inspect

import pytest

import phalanx
import phalanx.runtime

NAMES = [name for name in phalanx.__all__ if name != "__version__"]
CLASSES = [name for name in NAMES if inspect.isclass(getattr(phalanx, name))]


def own_doc(obj: object) -> str | None:
    """The docstring written on ``obj`` itself: none inherited, none a dataclass generated."""
    doc = obj.__doc__
    if inspect.isclass(obj) and doc is not None and doc.startswith(f"{obj.__name__}("):
        return None  # what @dataclass writes for a class without a docstring: its signature
    return doc


def public_members(cls: type) -> list[tuple[str, object]]:
    """The public methods and properties the class itself defines (not those it inherits)."""
    found = []
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if isinstance(value, property):
            found.append((name, value.fget))
        elif inspect.isfunction(value):
            found.append((name, value))
    return found


def parameters(obj: object) -> list[str]:
    """The parameters a user passes: ``self`` aside; for a class, those of its own ``__init__``."""
    if inspect.isclass(obj):
        if getattr(obj, "_is_protocol", False) or "__init__" not in vars(obj):
            return []
        obj = vars(obj)["__init__"]
    return [name for name in inspect.signature(obj).parameters if name != "self"]


def test_the_api_is_what_the_runtime_exports():
    assert set(NAMES) == set(phalanx.runtime.__all__)
    assert CLASSES and len(CLASSES) < len(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_every_public_name_has_a_docstring_with_an_example(name):
    obj = getattr(phalanx, name)
    doc = own_doc(obj)
    assert doc, f"phalanx.{name} has no docstring"
    assert "Example::" in doc, f"phalanx.{name}'s docstring has no Example:: section"
    if parameters(obj):
        assert "Args:" in doc or "Attributes:" in doc, f"phalanx.{name} takes arguments its docstring does not describe"


@pytest.mark.parametrize("name", CLASSES)
def test_every_public_method_and_property_has_a_docstring(name):
    cls = getattr(phalanx, name)
    members = public_members(cls)
    missing = [member for member, function in members if not (function.__doc__ or "").strip()]
    assert not missing, f"phalanx.{name}: no docstring on {', '.join(missing)}"


def test_a_removed_docstring_is_found():
    class Documented:
        """Documented.

        Example::

            Documented().method()
        """

        def method(self) -> None:
            """A method."""

        def undocumented(self) -> None:
            pass

        @property
        def value(self) -> int:
            return 0

    assert [name for name, function in public_members(Documented) if not function.__doc__] == ["undocumented", "value"]
