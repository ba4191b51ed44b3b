"""The OpenAPI document as a file: ``docs/openapi.json`` pins what the control plane serves at
``/openapi.json`` (tests/test_openapi.py fails when they differ). ``make openapi`` writes it anew:
``python -m hyperpod_sim.api.openapi_file docs/openapi.json``."""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def render(document: dict[str, Any]) -> str:
    """The file's text of a document: two-space indents, its keys in the served order."""
    return json.dumps(document, indent=2, ensure_ascii=False) + "\n"


def served_document() -> dict[str, Any]:
    """The document an app with the default settings serves (no setting changes it; building the
    app opens no database)."""
    from hyperpod_sim.api.app import create_app
    from hyperpod_sim.settings import Settings

    with tempfile.TemporaryDirectory() as data:
        document: dict[str, Any] = create_app(Settings(data_dir=Path(data))).openapi()
    return document


def main(argv: Sequence[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if len(args) != 1:
        print("usage: python -m hyperpod_sim.api.openapi_file PATH (e.g. docs/openapi.json)", file=sys.stderr)
        return 2
    Path(args[0]).write_text(render(served_document()), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
