"""One root for stagewise's exceptions, each still the builtin type it was; one check of a whole number."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import numpy as np
import pytest

import stagewise
from stagewise import StagewiseError
from stagewise.errors import is_whole, whole_number

BUILTINS = (ValueError, TypeError, RuntimeError, FloatingPointError)


def _exceptions() -> list[type[BaseException]]:
    """Every exception class a module of stagewise defines."""
    found = []
    for info in pkgutil.walk_packages(stagewise.__path__, "stagewise."):
        if info.name == "stagewise.__main__":
            continue
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, BaseException) and cls.__module__ == info.name:
                found.append(cls)
    return found


def test_every_exception_of_stagewise_is_a_stagewise_error_and_a_builtin_one() -> None:
    found = _exceptions()
    names = {cls.__name__ for cls in found}
    assert {"CaptureError", "CommTimeoutError", "CheckpointError", "LaunchError", "JobFileError"} <= names
    for cls in found:
        assert issubclass(cls, StagewiseError), cls
        assert cls is StagewiseError or issubclass(cls, BUILTINS), cls  # `except ValueError` still catches it


def test_a_whole_number_is_an_int_not_a_bool() -> None:
    assert is_whole(3) and is_whole(np.int64(3)) and not is_whole(True) and not is_whole(3.0)
    assert whole_number("n_stages", np.int32(4), least=1) == 4
    with pytest.raises(TypeError, match=r"^n_stages must be a whole number, got True$"):
        whole_number("n_stages", True)
    with pytest.raises(ValueError, match=r"^n_stages must be >= 1, got 0; give at least one stage$"):
        whole_number("n_stages", 0, least=1, fix="give at least one stage")
