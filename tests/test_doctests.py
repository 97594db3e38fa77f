"""Run the docstring examples of every xattn module as doctests.

Modules (and the modules of subpackages such as ``xattn.cli``) are discovered with
:func:`pkgutil.walk_packages`, so modules added later are picked up automatically. The
framework and command-line modules (``torch``, ``flax``, ``transformers``, ``cli``, the
layers' helpers ``_torch_layer`` and ``_flax_layer``, and the transformers hook's
``_hf_cache`` and ``_hf_masks``) are skipped only when an optional
dependency they need is not installed. The Keras modules (``keras``,
``_keras_layer``) are left out: Keras picks its backend when first imported, so their
examples run in a subprocess per backend (``check_doctests`` of ``tests/keras_checks.py``,
run by ``tests/test_keras_layer.py``).
Each docstring with examples is one test, so a failure names the function.
"""

from __future__ import annotations

import ast
import doctest
import importlib
import importlib.util
import inspect
import pkgutil
import re
from pathlib import Path

import pytest

import xattn

# may need extras that are not installed (the layers' framework helpers too)
OPTIONAL_MODULES = {"cli", "training", "torch", "flax", "transformers", "torch_layer",
                    "flax_layer", "flax_attention_fn", "hf_cache", "hf_masks",
                    "hf_calibration", "calibration_torch", "calibration_jax"}
OPTION_FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
# tested in subprocesses, one per Keras backend (tests/test_keras_layer.py)
SUBPROCESS_MODULES = {"xattn.keras", "xattn._integrations.keras_layer"}


def _module_names() -> list[str]:
    names = ["xattn"]
    names += [info.name for info in pkgutil.walk_packages(xattn.__path__, "xattn.")
              if not info.name.endswith(".__main__")  # __main__ would run the command
              and info.name not in SUBPROCESS_MODULES]
    return sorted(names)


def _import(name: str):
    try:
        return importlib.import_module(name)
    except ImportError as error:
        optional = OPTIONAL_MODULES.intersection(name.split(".")[1:])  # xattn.cli.bench too
        if optional and name not in str(error):
            return error  # an optional dependency of the module is missing
        raise


def _doctest_cases() -> list:
    finder = doctest.DocTestFinder(exclude_empty=True)
    cases = []
    for name in _module_names():
        module = _import(name)
        if isinstance(module, ImportError):
            cases.append(pytest.param(name, None, id=name,
                                      marks=pytest.mark.skip(reason=f"{module}")))
            continue
        for test in finder.find(module, name):
            if test.examples:
                cases.append(pytest.param(name, test.name, id=test.name))
    return cases


def test_every_module_is_discovered():
    found = _module_names()
    for expected in ("xattn._estimators.softmax", "xattn._estimators.lara", "xattn.random",
                     "xattn.features"):
        assert expected in found


@pytest.mark.parametrize(("module_name", "test_name"), _doctest_cases())
def test_docstring_examples(module_name, test_name):
    module = importlib.import_module(module_name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    (test,) = [t for t in finder.find(module, module_name) if t.name == test_name]
    output = []
    runner = doctest.DocTestRunner(optionflags=OPTION_FLAGS)
    result = runner.run(test, out=output.append)
    assert result.failed == 0, "".join(output)


def _public_callables():
    for name in xattn.__all__:
        if f"xattn.{name}" in SUBPROCESS_MODULES:  # getattr would import it
            continue
        obj = getattr(xattn, name)
        if inspect.isfunction(obj) or inspect.isclass(obj):
            yield pytest.param(obj, id=name)
    yield pytest.param(xattn.random.default_rng, id="random.default_rng")


@pytest.mark.parametrize("function", list(_public_callables()))
def test_public_functions_have_examples(function):
    """Every public function carries a numpydoc Examples section with runnable code."""
    docstring = inspect.getdoc(function) or ""
    assert "Examples\n--------" in docstring, f"{function.__qualname__} has no Examples"
    assert ">>> " in docstring, f"{function.__qualname__} has no runnable example"


# -- the API reference lists every public name ---------------------------------------------
API_PAGE = Path(__file__).resolve().parents[1] / "docs" / "api.rst"
#: The modules a user is told to import, whose ``__all__`` the API reference must cover.
#: (``xattn.cli`` is documented as a command; its page lists only ``main``.)
DOCUMENTED_MODULES = ("xattn", "xattn.random", "xattn.features", "xattn.diagnostics",
                      "xattn.mrf", "xattn.torch", "xattn.flax", "xattn.keras", "xattn.training")


def _api_page_names() -> set[str]:
    """Fully qualified names that docs/api.rst documents (autosummary entries, autodata)."""
    names, module, in_autosummary = set(), "xattn", False
    for line in API_PAGE.read_text().splitlines():
        if match := re.match(r"\.\. (?:currentmodule|automodule):: (\S+)", line):
            module, in_autosummary = match.group(1), False
        elif line.startswith(".. autosummary::"):
            in_autosummary = True
        elif match := re.match(r"\.\. auto(?:data|class|function|exception):: (\S+)", line):
            names.add(f"{module}.{match.group(1)}")
            in_autosummary = False
        elif in_autosummary and re.fullmatch(r"   [A-Za-z_][\w.]*", line):
            names.add(f"{module}.{line.strip()}")
        elif line and not line.startswith(" "):
            in_autosummary = False
    return names


def _public_names(module_name: str) -> list[str]:
    """``__all__`` of a module without its submodules (which have their own sections),
    read from the source for the modules not imported here (SUBPROCESS_MODULES)."""
    if module_name in SUBPROCESS_MODULES:
        path = Path(xattn.__file__).parent / f"{module_name.split('.')[-1]}.py"
        (assignment,) = [node for node in ast.parse(path.read_text()).body
                         if isinstance(node, ast.Assign)
                         and any(getattr(t, "id", None) == "__all__" for t in node.targets)]
        return ast.literal_eval(assignment.value)
    module = _import(module_name)
    if isinstance(module, ImportError):
        pytest.skip(f"{module}")
    return [name for name in module.__all__ if f"{module_name}.{name}" not in SUBPROCESS_MODULES
            and not inspect.ismodule(getattr(module, name))]


@pytest.mark.parametrize("module_name", DOCUMENTED_MODULES)
def test_api_reference_lists_every_public_name(module_name):
    documented = _api_page_names()
    missing = [name for name in _public_names(module_name)
               if f"{module_name}.{name}" not in documented]
    assert not missing, f"docs/api.rst does not document {module_name}: {missing}"


def test_intersphinx_inventories_are_up_to_date():
    """docs/_inventories/*.inv are what docs/_scripts/make_inventories.py writes."""
    script = API_PAGE.parent / "_scripts" / "make_inventories.py"
    spec = importlib.util.spec_from_file_location("make_inventories", script)
    make_inventories = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_inventories)
    assert make_inventories.main(["make_inventories.py", "--check"]) == 0
