"""The ``hyperpod-sim`` command. A thin shell: each subcommand imports its side lazily, so the
SDK-only install never pulls in the server."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from api.app import create_app
    from hyperpod_sim.settings import Settings

    overrides: dict[str, object] = {}
    if args.host is not None:
        overrides["host"] = args.host
    if args.port is not None:
        overrides["port"] = args.port
    if args.data_dir is not None:
        overrides["data_dir"] = args.data_dir
    settings = Settings(**overrides)  # type: ignore[arg-type]
    if args.database_url is not None:
        settings.database.url = args.database_url
    app = create_app(settings)
    print(
        f"hyperpod-sim control plane on http://{settings.host}:{settings.port} "
        f"(database: {settings.database_url()})",
        flush=True,
    )
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=args.log_level, access_log=False)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hyperpod-sim", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser(
        "serve",
        help="run the control plane",
        description="Run the control plane. Every flag can also be set by environment "
        "(HPSIM_HOST, HPSIM_PORT, HPSIM_DATABASE__URL, HPSIM_DATA_DIR).",
    )
    serve.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port to listen on (default 8080)")
    serve.add_argument("--database-url", help="SQLAlchemy URL (default: SQLite in the data dir)")
    serve.add_argument("--data-dir", help="directory for local state (default .hyperpod-sim)")
    serve.add_argument("--log-level", default="warning", help="uvicorn log level")
    serve.set_defaults(func=_serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
