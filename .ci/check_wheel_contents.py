"""Check the file lists of the built sdist and wheel against the source tree.

Usage: ``python .ci/check_wheel_contents.py DIST_DIR`` (the folder ``python -m build``
wrote, holding exactly one ``xattn-*.whl`` and one ``xattn-*.tar.gz``), or
``python .ci/check_wheel_contents.py --print-version`` (the version the build must have).

What is expected comes from the repository, not from a second list kept here:

- the version: ``[project] version`` of ``pyproject.toml`` or, when it is dynamic, the
  literal that ``[tool.setuptools.dynamic] version = {attr = ...}`` names;
- the modules: every ``.py`` file under ``src/xattn``;
- the package data: every file matched by the globs of ``[tool.setuptools.package-data]``
  (each glob must match at least one file, so a stale entry fails too);
- the license files: the ``license-files`` globs of ``[project]`` (setuptools' defaults
  when absent) that match files in the checkout.

The wheel must hold exactly those modules and data files under ``xattn/`` plus its
``xattn-VERSION.dist-info/`` (so no ``tests/``, ``benchmarks/``, ``docs/``, ``examples/``,
byte code or leftovers of an old build), with the version and console script in its
metadata. The sdist must hold ``pyproject.toml``, ``README.md``, ``PKG-INFO``, the license
files, every module and every data file.
"""

from __future__ import annotations

import argparse
import ast
import sys
import tarfile
import tomllib
import zipfile
from email.parser import HeaderParser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PACKAGE = "xattn"
#: setuptools' default ``license-files`` patterns (used when pyproject names none)
DEFAULT_LICENSE_GLOBS = ("LICEN[CS]E*", "COPYING*", "NOTICE*", "AUTHORS*")
#: folders of the repository that must never be installed
NOT_INSTALLED = ("tests", "benchmarks", "docs", "examples", ".ci")


def pyproject() -> dict:
    with (ROOT / "pyproject.toml").open("rb") as file:
        return tomllib.load(file)


def expected_version(config: dict) -> str:
    """``[project] version``, or the string literal named by the dynamic ``attr``."""
    project = config["project"]
    if "version" in project:
        return project["version"]
    assert "version" in project.get("dynamic", []), "pyproject.toml declares no version"
    attr = config["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    module_name, _, name = attr.rpartition(".")
    module = SRC.joinpath(*module_name.split("."))
    path = module / "__init__.py" if module.is_dir() else module.with_suffix(".py")
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name) and node.targets[0].id == name):
            value = ast.literal_eval(node.value)
            assert isinstance(value, str), f"{attr} is not a string literal"
            return value
    raise AssertionError(f"no literal assignment of {name} in {path}")


def expected_modules() -> set[str]:
    """Every ``.py`` file of the package, as a path inside the wheel."""
    return {path.relative_to(SRC).as_posix() for path in (SRC / PACKAGE).rglob("*.py")
            if "__pycache__" not in path.parts}


def expected_package_data(config: dict) -> set[str]:
    """The files the ``[tool.setuptools.package-data]`` globs match, as wheel paths."""
    table = config["tool"]["setuptools"].get("package-data", {})
    files = set()
    for package, patterns in table.items():
        assert package != "*", "package-data for '*' is not supported by this check"
        folder = SRC.joinpath(*package.split("."))
        for pattern in patterns:
            matches = [path for path in folder.glob(pattern) if path.is_file()]
            assert matches, f"package-data {package}: {pattern!r} matches no file"
            files |= {path.relative_to(SRC).as_posix() for path in matches}
    return files


def license_files(config: dict) -> set[str]:
    patterns = config["project"].get("license-files", DEFAULT_LICENSE_GLOBS)
    return {path.relative_to(ROOT).as_posix() for pattern in patterns
            for path in ROOT.glob(pattern) if path.is_file()}


def the_one(dist: Path, pattern: str) -> Path:
    found = sorted(dist.glob(pattern))
    assert len(found) == 1, f"expected one {pattern} in {dist}, found {[p.name for p in found]}"
    return found[0]


def check_wheel(wheel: Path, version: str, modules: set[str], data: set[str],
                licenses: set[str]) -> list[str]:
    dist_info = f"{PACKAGE}-{version}.dist-info"
    assert wheel.name == f"{PACKAGE}-{version}-py3-none-any.whl", \
        f"wheel {wheel.name}: expected version {version}, pure Python (py3-none-any)"
    with zipfile.ZipFile(wheel) as archive:
        names = [name for name in archive.namelist() if not name.endswith("/")]
        metadata = HeaderParser().parsestr(archive.read(f"{dist_info}/METADATA").decode())
        entry_points = archive.read(f"{dist_info}/entry_points.txt").decode()
    files = set(names)
    assert len(files) == len(names), "the wheel holds a file twice"

    stray = sorted(name for name in files if set(name.split("/")[:-1]) & set(NOT_INSTALLED))
    assert not stray, f"tests, benchmarks, docs or examples in the wheel: {stray}"
    tops = {name.split("/", 1)[0] for name in files}
    assert tops == {PACKAGE, dist_info}, f"wheel top-level entries: {sorted(tops)}"
    assert not [n for n in files if "__pycache__" in n or n.endswith((".pyc", ".pyo"))], \
        "byte code in the wheel"

    package_files = {name for name in files if name.startswith(f"{PACKAGE}/")}
    missing = (modules | data) - package_files
    extra = package_files - modules - data
    assert not missing, f"missing from the wheel: {sorted(missing)}"
    assert not extra, f"in the wheel but neither a module nor package data: {sorted(extra)}"

    for name in licenses:
        assert f"{dist_info}/licenses/{name}" in files, f"license file {name} not in the wheel"
    assert metadata["Name"] == PACKAGE and metadata["Version"] == version, \
        f"METADATA: {metadata['Name']} {metadata['Version']}"
    assert f"{PACKAGE} = {PACKAGE}.cli:main" in entry_points, "console script xattn missing"
    return names


def check_sdist(sdist: Path, version: str, modules: set[str], data: set[str],
                licenses: set[str]) -> list[str]:
    base = f"{PACKAGE}-{version}"
    assert sdist.name == f"{base}.tar.gz", f"sdist {sdist.name}: expected version {version}"
    with tarfile.open(sdist) as archive:
        names = [member.name for member in archive.getmembers() if member.isfile()]
    files = {name.removeprefix(f"{base}/") for name in names}
    assert all(name.startswith(f"{base}/") for name in names), "sdist without a top folder"
    required = {"pyproject.toml", "README.md", "PKG-INFO", *licenses}
    required |= {f"src/{name}" for name in modules | data}
    missing = required - files
    assert not missing, f"missing from the sdist: {sorted(missing)}"
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dist", nargs="?", type=Path, help="folder with the sdist and wheel")
    parser.add_argument("--print-version", action="store_true",
                        help="print the version the build must have, and stop")
    args = parser.parse_args(argv)
    config = pyproject()
    version = expected_version(config)
    if args.print_version:
        print(version)
        return 0
    if args.dist is None:
        parser.error("DIST_DIR is required")

    modules, data, licenses = expected_modules(), expected_package_data(config), \
        license_files(config)
    assert licenses, ("the project has no license file, but pyproject says license = "
                      f"{config['project'].get('license')!r}: the text must ship")
    wheel = check_wheel(the_one(args.dist, f"{PACKAGE}-*.whl"), version, modules, data,
                        licenses)
    sdist = check_sdist(the_one(args.dist, f"{PACKAGE}-*.tar.gz"), version, modules, data,
                        licenses)
    print(f"wheel: {len(wheel)} files ({len(modules)} modules, package data "
          f"{', '.join(sorted(data))}, {len(wheel) - len(modules) - len(data)} in the "
          f"dist-info); sdist: {len(sdist)} files; version {version}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
