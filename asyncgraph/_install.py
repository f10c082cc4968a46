"""How to install an extra, said as it works from where this asyncgraph came from.

asyncgraph is not on the package index yet: ``pip install "asyncgraph[fleet]"`` finds
nothing there. ``install_hint("fleet")`` reads how this copy was installed (pip's
``direct_url.json``, PEP 610) and names the command that works for it: from a clone
(an editable or local install), ``pip install -e "/path/to/clone[fleet]"``; from a Git
URL, ``pip install "asyncgraph[fleet] @ git+URL"``; and the package index's form, which
works once asyncgraph is published. Installed from a built wheel or sdist (or where it came
from cannot be told), the hint says both: the index's form for once it is published, and
the clone's until then.
"""

from __future__ import annotations

import functools
import json
import shlex
from pathlib import Path

__all__ = ["install_hint"]

_INDEX_FORM = "pip install 'asyncgraph[{extra}]'"


@functools.cache
def _origin() -> tuple[str, str] | None:
    """('dir', the clone's path) when this asyncgraph runs from a source tree (an editable
    install or a checkout on sys.path), ('vcs', 'git+URL') when pip installed it from a
    repository, None when it came from a package index (or cannot be told)."""
    root = Path(__file__).resolve().parent.parent
    if (root / "pyproject.toml").is_file() and (root / "asyncgraph" / "__init__.py").is_file():
        return ("dir", str(root))
    from importlib import metadata

    for dist in metadata.distributions(name="asyncgraph"):
        text = dist.read_text("direct_url.json")
        if not text:
            continue
        try:
            info = json.loads(text)
            url = str(info["url"])
            vcs = info.get("vcs_info")
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
        if isinstance(vcs, dict):
            return ("vcs", f"{vcs.get('vcs', 'git')}+{url}")
    return None


def install_hint(extra: str) -> str:
    """The command that installs asyncgraph's ``extra`` here, e.g.
    ``pip install -e '/home/me/asyncgraph[fleet]' (in a clone; once asyncgraph is on the
    package index: pip install 'asyncgraph[fleet]')``."""
    index = _INDEX_FORM.format(extra=extra)
    origin = _origin()
    if origin is None:  # a wheel or sdist: the index's form cannot work yet
        return (
            f"{index} once asyncgraph is published on the package index; until then, "
            f"in a clone of its repository: pip install -e {shlex.quote(f'.[{extra}]')}"
        )
    kind, where = origin
    later = f"once asyncgraph is published on the package index: {index}"
    if kind == "dir":
        return f"pip install -e {shlex.quote(f'{where}[{extra}]')} (in your clone; {later})"
    spec = shlex.quote(f"asyncgraph[{extra}] @ {where}")
    return f"pip install {spec} (from its repository; {later})"
