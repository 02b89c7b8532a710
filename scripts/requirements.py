"""Print the requirements of omniep and of the extras named on the command line, one per line, read from
pyproject.toml (the only place they are written): `make` installs them before building omniep without
build isolation, so that CMake sees jax and torch."""

import pathlib
import sys

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

project = tomllib.loads((pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
print("\n".join(project["dependencies"] + [req for extra in sys.argv[1:] for req in project["optional-dependencies"][extra]]))
