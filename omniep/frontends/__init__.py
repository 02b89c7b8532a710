

import importlib


def require_framework(module: str, name: str, install: str) -> None:
    """Import ``module`` (the frontend's framework); if it is not installed, a ModuleNotFoundError that
    says which frontend needs it and what to install (anything else it raises passes unchanged)."""
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module:
            raise
        raise ModuleNotFoundError(f"omniep.{module} needs {name}: {install}", name=module) from None
